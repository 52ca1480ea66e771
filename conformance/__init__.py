"""Resume-determinism conformance suite for PyTorch training checkpoints."""
__version__ = "0.1.0"
