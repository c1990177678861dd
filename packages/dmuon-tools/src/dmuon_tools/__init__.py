"""dmuon-tools: diagnostics, plots and a partition planner for dmuon."""

__version__ = "0.1.0"
