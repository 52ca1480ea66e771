"""What the suite runs: a trainer command, or a Python adapter object run in a child process.

Both reduce to one argv; a Python adapter `pkg.mod:attr` runs as
`python -m conformance.run.child pkg.mod:attr`, so every crash mechanism works on both. Adapter specs
import the way `python -m` would: with the current directory (and pytest's rootdir) on sys.path,
and trainer processes get the same directories on PYTHONPATH.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .flags import BY_NAME
from .importing import current_spelling, python_target_problem, why_not_importable

BUNDLED = "resume_conformance.fixtures.reference_trainer:ADAPTER"

class Capability(enum.StrEnum):
    """What an adapter may declare it can do; a check needing one the adapter lacks is skipped
    naming it. Values are the strings an adapter's `capabilities` may hold."""

    COLD_TIER = "cold_tier"
    EXTENDABLE = "extendable"
    KEEP_BEST = "keep_best"
    LEGACY_SAMPLES = "legacy_samples"
    NODE_LOCAL_STORAGE = "node_local_storage"
    PREEMPTION_SAVE = "preemption_save"
    RESHARD = "reshard"
    RESUME_FROM = "resume_from"
    SHARDED = "sharded"
    SYSCALL_CRASH = "syscall_crash"


KNOWN_CAPABILITIES = frozenset(Capability)


class AdapterError(ValueError):
    """The trainer cannot be named or loaded as given: `cause` says what is wrong, `fix` what to do."""

    def __init__(self, cause: str, fix: str):
        super().__init__(f"{cause}\n  fix: {fix}")
        self.cause, self.fix = cause, fix


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
    pythonpath: tuple[str, ...] = ()   # directories its processes need on PYTHONPATH
    world_size: int = 1     # > 1: launched as that many ranks by torchrun (launch.py)
    nnodes: int = 1         # > 1: the ranks spread over that many torchrun agents ("nodes", launch.py)
    settings: tuple[str, ...] = ()   # the run's verdict-changing options (flags.replay_settings), for replay
    steps: int | None = None         # runs of this many steps instead of TOTAL_STEPS (>= it)
    # --carry-env: each named variable with its value when the trainer was resolved (None: unset), for replay
    carried_env: tuple[tuple[str, str | None], ...] = ()
    env_left_out: tuple[str, ...] = ()   # variables set then that may choose the trainer's variant, not named

    def __post_init__(self):
        caps = frozenset(capabilities(self.capabilities, f"adapter {self.name!r}"))
        object.__setattr__(self, "capabilities", caps)
        if self.steps is not None:
            from .settings import TOTAL_STEPS
            if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < TOTAL_STEPS:
                raise AdapterError(f"adapter {self.name!r}: steps={self.steps!r} must be an integer >= {TOTAL_STEPS} "
                                   "(the suite's shortest run)",
                                   f"give `steps` as a whole number of steps, at least the suite's {TOTAL_STEPS}")

    @property
    def total_steps(self) -> int:
        """How many steps the suite's runs train: TOTAL_STEPS, or more when the adapter asks with
        `steps` (a trainer whose retention or full-checkpoint cadence needs a longer run before
        it deletes anything, so that crash and power-loss states cover its retention pass)."""
        from .settings import TOTAL_STEPS
        return self.steps or TOTAL_STEPS

    @property
    def is_command(self) -> bool:
        """Named by --trainer-cmd: it declares capabilities through --capabilities."""
        return self.spec.startswith("cmd:")

    def has(self, capability: str) -> bool:
        if capability == "legacy_samples":
            return bool(self.legacy_samples)
        return capability in self.capabilities

    def lacks(self, capability: str) -> str:
        """The skip message of a check that needs `capability`, which this trainer lacks."""
        how = f" (a trainer command declares it: --capabilities={capability})" \
            if self.is_command and capability in DECLARABLE else ""
        return f"adapter lacks capability '{capability}'{how}"

    def replay_args(self) -> tuple[str, ...]:
        """Command-line arguments that name this trainer again, with the options it ran under (unquoted)."""
        ranks = (f"--world-size={self.world_size}",) if self.world_size > 1 else ()
        ranks += (f"--nnodes={self.nnodes}",) if self.nnodes > 1 else ()
        carried = (f"--carry-env={','.join(name for name, _ in self.carried_env)}",) if self.carried_env else ()
        if self.is_command:
            declared = sorted(self.capabilities - COMMAND_CAPABILITIES)
            declared_args = (f"--capabilities={','.join(declared)}",) if declared else ()
            return (f"--trainer-cmd={self.spec[4:]}", *declared_args, *ranks, *self.settings, *carried)
        return (f"--adapter={self.spec}", *ranks, *self.settings, *carried)

    def replay_env(self) -> tuple[str, ...]:
        """What goes before `python` in the replay line (unquoted): `env` with each carried
        variable as the run had it (NAME=VALUE, or -u NAME where it was unset), so that the replay's
        own interpreter and every process it starts read them from their start, as the run's did."""
        if not self.carried_env:
            return ()
        unset = [arg for name, value in self.carried_env if value is None for arg in ("-u", name)]
        return ("env", *unset, *(f"{name}={value}" for name, value in self.carried_env if value is not None))

    def replay_note(self) -> str | None:
        """The line under the replay line naming what it does not carry, or None."""
        if not self.env_left_out:
            return None
        names = ", ".join(self.env_left_out)
        return (f"not carried: {names} (set in this run; variables of this kind can choose the trainer's variant: "
                f"--carry-env={','.join(n for n, _ in self.carried_env) + ',' if self.carried_env else ''}"
                f"{','.join(self.env_left_out)} puts their values in the replay line)")

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this adapter's import directories first on PYTHONPATH."""
        if self.pythonpath:
            rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*self.pythonpath, *rest]))
        return env


def import_dirs(rootdir: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Where adapter specs are imported from, besides sys.path: the current directory and pytest's
    rootdir (`python -m` puts the current directory first; plain `pytest` does not)."""
    dirs = [os.getcwd()] + ([os.fspath(rootdir)] if rootdir else [])
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))


def command_adapter(cmd: str, *, capabilities: frozenset[str] | None = None) -> TrainerAdapter:
    """The trainer `cmd` starts, with COMMAND_CAPABILITIES and `capabilities`."""
    argv = tuple(shlex.split(cmd))
    if not argv:
        raise AdapterError("--trainer-cmd is empty", 'give the command that starts your trainer, e.g. '
                           '--trainer-cmd="python train.py --small"')
    exe = argv[0]
    found = shutil.which(exe) if os.sep not in exe else (exe if os.path.isfile(exe) else None)
    if found is None:
        raise AdapterError(f"--trainer-cmd {cmd!r}: {exe!r} is not a program on PATH or a file",
                           "check the spelling, or give the full path of the interpreter or script")
    if not os.access(found, os.X_OK):
        raise AdapterError(f"--trainer-cmd {cmd!r}: {found} is not executable",
                           f"chmod +x {found}, or start it through its interpreter (python {exe})")
    problem = python_target_problem(argv, found, import_dirs())
    if problem:
        raise AdapterError(f"--trainer-cmd {cmd!r}: {problem[0]}", problem[1])
    return TrainerAdapter(name=Path(argv[-1]).name if len(argv) == 1 else " ".join(argv[-2:]),
                          argv=argv, capabilities=COMMAND_CAPABILITIES | (capabilities or frozenset()),
                          spec=f"cmd:{cmd}", pythonpath=import_dirs())


def load_object(spec: str, search: tuple[str, ...] = ()) -> Any:
    """Import `pkg.module:attr` (attr may be dotted), with `search` directories on sys.path."""
    if ":" not in spec or not spec.partition(":")[0] or not spec.partition(":")[2]:
        raise AdapterError(f"adapter {spec!r} is not 'package.module:attribute'",
                           "name the module and the object in it, e.g. --adapter=mypkg.train:ADAPTER")
    for directory in reversed(search):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    spec = respelled(spec)
    module_name, attr = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        cause, fix = why_not_importable(module_name, exc, search)
        raise AdapterError(f"adapter {spec!r}: {cause}", fix) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AdapterError(f"adapter {spec!r}: module {module_name!r} has no attribute {part!r}",
                               f"define {attr} in {module_name}, or fix the name after the colon") from None
    return obj


_told: set[str] = set()


def respelled(spec: str) -> str:
    """`spec` with a bundled trainer's old top-level spelling replaced (one line on stderr says so)."""
    module_name, colon, attr = spec.partition(":")
    new = current_spelling(module_name)
    if new is None:
        return spec
    if spec not in _told:
        _told.add(spec)
        print(f"conformance: {module_name!r} is now spelled {new!r}: give {new}{colon}{attr}", file=sys.stderr)
    return f"{new}{colon}{attr}"


def python_adapter(spec: str, search: tuple[str, ...] = ()) -> TrainerAdapter:
    """Resolve `pkg.mod:attr`: a ready TrainerAdapter, or an object with `run(ctx)`."""
    if ":" in spec:
        spec = respelled(spec)
    obj = load_object(spec, search)
    if isinstance(obj, TrainerAdapter):
        return dataclasses.replace(obj, spec=obj.spec or spec, pythonpath=obj.pythonpath or search)
    run = getattr(obj, "run", None)
    if not callable(run):
        raise AdapterError(f"adapter {spec!r} is neither a TrainerAdapter nor an object with run(ctx)",
                           "give it a run(ctx) method (see the README's adapter example)")
    caps = capabilities(getattr(obj, "capabilities", frozenset({"syscall_crash"})), f"adapter {spec!r}")
    samples = tuple(getattr(obj, "legacy_samples", ()) or ())
    world = checked_world_size(getattr(obj, "world_size", 1), f"adapter {spec!r}: world_size")
    nodes = checked_world_size(getattr(obj, "nnodes", 1), f"adapter {spec!r}: nnodes", "nodes")
    return TrainerAdapter(name=getattr(obj, "name", spec), argv=(sys.executable, "-m", "conformance.run.child", spec),
                          capabilities=caps, legacy_samples=samples, spec=spec, steps=getattr(obj, "steps", None),
                          version=str(getattr(obj, "version", "") or ""), pythonpath=search,
                          world_size=world, nnodes=nodes)


def capabilities(values, what: str) -> frozenset[Capability]:
    """Capability names (strings, as an adapter or a command line gives them) as typed values;
    AdapterError naming the unknown ones."""
    if isinstance(values, str):
        values = (values,)
    unknown = sorted(str(v) for v in values if v not in KNOWN_CAPABILITIES)
    if unknown:
        moved = [v for v in unknown if v.startswith("steps=")]
        raise AdapterError(f"{what} declares unknown capabilities {unknown}"
                           + (f" ({moved[0]} is now the adapter attribute `steps = {moved[0][6:]}`)" if moved else ""),
                           f"use only {', '.join(sorted(KNOWN_CAPABILITIES))}; a longer run is the attribute `steps = N`")
    return frozenset(Capability(v) for v in values)


def checked_world_size(value, what: str, unit: str = "ranks") -> int:
    """A world size (or, with unit "nodes", a node count) as given (an adapter attribute, an
    option, an ini value), or AdapterError."""
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or str(value).strip() != str(size):
        fix = ("give the number of ranks the trainer runs as, e.g. --world-size=2 (1: one process)" if unit == "ranks"
               else "give the number of torchrun agents the ranks spread over, e.g. --nnodes=2 (1: one node)")
        raise AdapterError(f"{what} is {value!r}, not a whole number >= 1", fix)
    return size


def checked_shape(adapter: TrainerAdapter) -> TrainerAdapter:
    """`adapter` if its ranks spread evenly over its nodes (torchrun gives every node the same
    number of local ranks), else AdapterError."""
    nodes, size = adapter.nnodes, adapter.world_size
    if nodes > 1 and (size % nodes or size < nodes):
        raise AdapterError(f"--nnodes={nodes} does not divide --world-size={size}: every node runs the same number of "
                           "ranks", f"give a world size that is a multiple of {nodes}, e.g. --world-size={2 * nodes}")
    if nodes > 80:
        raise AdapterError(f"--nnodes={nodes}: at most 80 nodes are started on one machine",
                           "give fewer nodes")
    return adapter


def resolve(adapter: str | None, trainer_cmd: str | None, *, rootdir: str | os.PathLike | None = None,
            world_size: int | str | None = None, nnodes: int | str | None = None, capabilities: str | None = None,
            carry_env: str | None = None, environ: Mapping[str, str] | None = None) -> TrainerAdapter:
    """The trainer under test; `world_size` and `nnodes` (options) override the adapter's own;
    `capabilities` and `carry_env` are the options' text (declared()). `environ`: the run's
    environment (default: this process's)."""
    if adapter and trainer_cmd:
        raise AdapterError("both an adapter and a trainer command are given", "keep one of --adapter and --trainer-cmd")
    found = command_adapter(trainer_cmd) if trainer_cmd else python_adapter(adapter or BUNDLED, import_dirs(rootdir))
    if world_size is not None:
        found = dataclasses.replace(found, world_size=checked_world_size(world_size, "--world-size"))
    if nnodes is not None:
        found = dataclasses.replace(found, nnodes=checked_world_size(nnodes, "--nnodes", "nodes"))
    found = declared(found, capabilities, carry_env, os.environ if environ is None else environ)
    return checked_shape(found)   # its capabilities and steps were checked when it was made


# -- what the options declare for any trainer: capabilities, and the environment its replay carries --
COMMAND_CAPABILITIES = frozenset({Capability.SYSCALL_CRASH})   # what a trainer command has undeclared
# What --capabilities may name: legacy_samples is an adapter's list of sample checkpoints, not a name.
DECLARABLE = KNOWN_CAPABILITIES - {Capability.LEGACY_SAMPLES}

# Variables through which the libraries a PyTorch trainer is built on choose what it computes
# (DeepSpeed's DS_ACCELERATOR, Accelerate's ACCELERATE_MIXED_PRECISION, NCCL's reduction algorithm,
# the number of threads a CPU reduction is split over): set in a run and not carried, its replay may
# train another variant. A name that says where files are or who the user is is not one of them.
VARIANT_PREFIXES = ("DS_", "DEEPSPEED_", "ACCELERATE_", "LIGHTNING_", "PL_", "TORCH_", "PYTORCH_", "NCCL_", "CUBLAS_",
                    "CUDNN_")
VARIANT_NAMES = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED"})
NOT_VARIANT_SUFFIXES = ("_HOME", "_CACHE", "_DIR", "_PATH", "_TOKEN", "_KEY")
SUITE_PREFIX = "CONFORMANCE_"   # the suite's own namespace: the contract's variables, set for every trainer process
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def names(text: str | None) -> list[str]:
    """An option's list of names: separated by commas or white space (an ini value may span lines)."""
    return [n for n in re.split(r"[\s,]+", text or "") if n]


def declared(found: TrainerAdapter, capability_names: str | None, carry_env: str | None,
             environ: Mapping[str, str]) -> TrainerAdapter:
    """`found` with what the options declare: --capabilities (a trainer command's, besides
    COMMAND_CAPABILITIES) and --carry-env (any trainer's), whose values are taken from `environ`
    now, with the variables there that may choose the trainer's variant but are not named."""
    option = BY_NAME["capabilities"]
    given = names(capability_names)
    if given:
        where = f"{option.spelling} (ini key {option.ini_key})"
        if not found.is_command:
            raise AdapterError(f"{where} declares a trainer command's capabilities, but the trainer is the Python adapter "
                               f"{found.spec!r}, which declares its own ({', '.join(sorted(found.capabilities)) or 'none'})",
                               "declare them in the adapter's `capabilities` (the adapter is the one place that says "
                               f"what it can do), or drop {option.spelling}")
        if Capability.LEGACY_SAMPLES in given:
            raise AdapterError(f"{where}: legacy_samples is not declared by name: it is the list of a Python adapter's "
                               "sample checkpoints (LegacySample(path, name, seed, step))",
                               "give schema_migration its samples through a Python adapter's `legacy_samples`, or "
                               f"drop legacy_samples from {option.spelling}")
        unknown = [n for n in given if n not in KNOWN_CAPABILITIES]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(map(str, DECLARABLE)), n=1, cutoff=0.5)
            raise AdapterError(f"{where}: {unknown[0]!r} is not a capability"
                               + (f" (did you mean {near[0]!r}?)" if near else ""),
                               f"give names of conformance.Capability, comma-separated: {', '.join(sorted(DECLARABLE))}")
        found = dataclasses.replace(found, capabilities=found.capabilities | capabilities(given, where))
    carried = carried_names(carry_env)
    left_out = tuple(sorted(n for n, value in environ.items() if value and n not in carried and variant_variable(n)))
    return dataclasses.replace(found, carried_env=tuple((n, environ.get(n)) for n in carried), env_left_out=left_out)


def carried_names(text: str | None) -> tuple[str, ...]:
    """--carry-env's names, checked: environment variable names, none of the suite's own."""
    option = BY_NAME["carry_env"]
    where = f"{option.spelling} (ini key {option.ini_key})"
    given = names(text)
    for name in given:
        if not _ENV_NAME.fullmatch(name):
            raise AdapterError(f"{where}: {name!r} is not an environment variable's name",
                               f"give names only, comma-separated, e.g. {option.spelling}=DS_ZERO_STAGE,MY_VARIANT: "
                               "the replay line takes their values from this run")
        if name.startswith(SUITE_PREFIX):
            raise AdapterError(f"{where}: {name} is in the suite's own namespace ({SUITE_PREFIX}*): the suite sets the "
                               "contract's variables for every trainer process itself, and never carries one",
                               f"leave {name} out of {option.spelling}")
    return tuple(dict.fromkeys(given))


def variant_variable(name: str) -> bool:
    """Whether a variable may choose the trainer's variant (VARIANT_PREFIXES, VARIANT_NAMES)."""
    if name in VARIANT_NAMES:
        return True
    return name.startswith(VARIANT_PREFIXES) and not name.endswith(NOT_VARIANT_SUFFIXES)
