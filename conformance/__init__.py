"""Resume-determinism conformance suite for PyTorch training checkpoints."""
__version__ = "0.1.0"

from .adapters import LegacySample, TrainerAdapter  # noqa: E402


def __getattr__(name):
    # Imported lazily: the suite's Hypothesis settings must be built after pytest has loaded the
    # chosen --hypothesis-profile, and this package is imported earlier, as a pytest plugin.
    if name == "ResumeConformance":
        from .suite import ResumeConformance
        return ResumeConformance
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")


__all__ = ["LegacySample", "ResumeConformance", "TrainerAdapter", "__version__"]
