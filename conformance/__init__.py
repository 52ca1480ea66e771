"""Resume-determinism conformance suite for PyTorch training checkpoints."""
from .model.adapters import Capability, LegacySample, TrainerAdapter
from .model.context import RunContext, Trainer
from .model.settings import VERSION as __version__

# The subpackages in import order, lowest first ("" is the modules directly in this package): a module
# imports only from its own layer or below. tests/test_conformance_layout.py checks it, and docs/design.md's
# module table is generated from it.
LAYERS = (("model",), ("trace",), ("run",), ("offline",), ("faults",), ("checks",), ("report",), ("cli", "bench"), ("",))


def __getattr__(name):
    # Imported lazily: the suite's Hypothesis settings must be built after pytest has loaded the
    # chosen --hypothesis-profile, and this package is imported earlier, as a pytest plugin.
    if name == "ResumeConformance":
        from .suite import ResumeConformance
        return ResumeConformance
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")


__all__ = ["LAYERS", "Capability", "LegacySample", "ResumeConformance", "RunContext", "Trainer", "TrainerAdapter",
           "__version__"]
