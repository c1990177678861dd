"""Optimizer-step benchmarks: one step of dmuon (or its fused passes) without a model."""
