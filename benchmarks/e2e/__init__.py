"""End-to-end benchmarks: whole training iterations, cold starts, convergence, checkpoints."""
