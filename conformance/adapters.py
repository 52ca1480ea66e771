"""What the suite runs: a trainer command, or a Python adapter object run in a child process.

Both reduce to one argv; a Python adapter `pkg.mod:attr` runs as
`python -m conformance.child pkg.mod:attr`, so every crash mechanism works on both.
"""
from __future__ import annotations

import dataclasses
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

BUNDLED = "fixtures.reference_trainer:ADAPTER"

# Capabilities an adapter may declare; a check needing one the adapter lacks is skipped naming it.
KNOWN_CAPABILITIES = frozenset({"legacy_samples", "sharded", "syscall_crash"})


@dataclasses.dataclass(frozen=True)
class LegacySample:
    """A checkpoint in an old schema: copy `path` into the checkpoint directory (as `name`) and the
    trainer, started with `seed`, resumes it at `step` + 1 and matches the seed's baseline."""

    path: Path
    name: str
    seed: int
    step: int


@dataclasses.dataclass(frozen=True)
class TrainerAdapter:
    """A trainer the suite can start as a fresh process following the command contract."""

    name: str
    argv: tuple[str, ...]
    capabilities: frozenset[str] = frozenset({"syscall_crash"})
    legacy_samples: tuple[LegacySample, ...] = ()
    spec: str = ""          # how to name it again on a command line (for replay)
    version: str = ""       # the trainer's own version, shown in reports

    def has(self, capability: str) -> bool:
        if capability == "legacy_samples":
            return bool(self.legacy_samples)
        return capability in self.capabilities

    def replay_args(self) -> tuple[str, ...]:
        """Command-line arguments that name this trainer again (unquoted)."""
        if self.spec.startswith("cmd:"):
            return (f"--trainer-cmd={self.spec[4:]}",)
        return (f"--adapter={self.spec}",)


def command_adapter(cmd: str, *, capabilities: frozenset[str] | None = None) -> TrainerAdapter:
    argv = tuple(shlex.split(cmd))
    if not argv:
        raise ValueError("--trainer-cmd is empty")
    return TrainerAdapter(name=Path(argv[-1]).name if len(argv) == 1 else " ".join(argv[-2:]),
                          argv=argv, capabilities=capabilities or frozenset({"syscall_crash"}),
                          spec=f"cmd:{cmd}")


def load_object(spec: str) -> Any:
    """Import `pkg.module:attr` (attr may be dotted)."""
    if ":" not in spec:
        raise ValueError(f"adapter {spec!r} must look like 'package.module:attribute'")
    module_name, attr = spec.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def python_adapter(spec: str) -> TrainerAdapter:
    """Resolve `pkg.mod:attr`: a ready TrainerAdapter, or an object with `run(ctx)`."""
    obj = load_object(spec)
    if isinstance(obj, TrainerAdapter):
        return dataclasses.replace(obj, spec=obj.spec or spec)
    run = getattr(obj, "run", None)
    if not callable(run):
        raise TypeError(f"adapter {spec!r} is neither a TrainerAdapter nor an object with run(ctx)")
    caps = frozenset(getattr(obj, "capabilities", frozenset({"syscall_crash"})))
    unknown = caps - KNOWN_CAPABILITIES
    if unknown:
        raise ValueError(f"adapter {spec!r} declares unknown capabilities {sorted(unknown)}; "
                         f"known: {sorted(KNOWN_CAPABILITIES)}")
    samples = tuple(getattr(obj, "legacy_samples", ()) or ())
    return TrainerAdapter(name=getattr(obj, "name", spec), argv=(sys.executable, "-m", "conformance.child", spec),
                          capabilities=caps, legacy_samples=samples, spec=spec,
                          version=str(getattr(obj, "version", "") or ""))


def resolve(adapter: str | None, trainer_cmd: str | None) -> TrainerAdapter:
    if adapter and trainer_cmd:
        raise ValueError("give either --adapter or --trainer-cmd, not both")
    if trainer_cmd:
        return command_adapter(trainer_cmd)
    return python_adapter(adapter or BUNDLED)
