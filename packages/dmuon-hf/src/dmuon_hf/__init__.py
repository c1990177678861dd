"""dmuon-hf: HuggingFace Trainer integration for dmuon."""

__version__ = "0.1.0"
