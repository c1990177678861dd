"""Correctness checks on CUDA (or gloo on one GPU) against a single-process reference."""
