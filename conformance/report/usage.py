"""What the first screen of a run says: which trainer, profile, runner and strace are in use, and
the usage mistakes caught before any test runs (each one error: a cause and a fix)."""
from __future__ import annotations

import difflib
import functools
import os
import shutil
import subprocess

from ..model.adapters import TrainerAdapter
from ..run.forkserver import warm_target
from ..trace.strace import strace_problem


@functools.lru_cache(maxsize=1)
def strace_version() -> str | None:
    exe = shutil.which("strace")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = out.split()
    return words[3] if len(words) > 3 and words[:3] == ["strace", "--", "version"] else (words[-1] if words else None)


def runner_choice(adapter: TrainerAdapter, runner_option: str | None) -> tuple[str, str]:
    """("warm" or "fresh", why)."""
    if runner_option == "fresh":
        return "fresh", "--runner=fresh: a new interpreter per trainer process"
    target, why = warm_target(adapter)
    if target is not None:
        what = target.target if target.kind == "module" else os.path.basename(target.target)
        return "warm", f"processes forked from one that imported torch and {what} once"
    return "fresh", (f"{why}, so every trainer process starts a new interpreter and imports torch (seconds "
                     "each; `python -m pkg.train` or `python train.py` with an interpreter that imports this "
                     "torch runs warm)")


def describe_setup(adapter: TrainerAdapter, runner_option: str | None) -> str:
    """The header line: trainer, Hypothesis profile, runner and strace, each with why."""
    from hypothesis import settings
    runner, why = runner_choice(adapter, runner_option)
    version = strace_version()
    problem = strace_problem() if version else "strace is not installed"
    if not adapter.has("syscall_crash"):
        problem = "the adapter lacks capability 'syscall_crash'"
    crash = "on" if problem is None else f"off: {problem}"
    ranks = f", {adapter.world_size} ranks under torchrun" if adapter.world_size > 1 else ""
    return (f"conformance: trainer {adapter.name} ({adapter.spec}){ranks}, profile "
            f"{settings.get_current_profile_name()}, runner {runner} ({why}), strace {version or '-'} "
            f"(syscall crash points {crash})")


def multirank_problems(adapter: TrainerAdapter, port: int | None) -> tuple[str | None, str | None]:
    """(usage error, warning) for a multi-rank trainer: torchrun missing or the fixed rendezvous
    port taken is an error; more ranks than cores only a warning (gloo ranks can share cores)."""
    from ..run.launch import LaunchError, check_port, torchrun_program
    if adapter.world_size <= 1:
        return None, None
    try:
        torchrun_program()
        if port is not None:
            check_port(port)
    except LaunchError as exc:
        return str(exc), None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if adapter.world_size > cores:
        return None, (f"world size {adapter.world_size} is larger than the {cores} CPU core(s) here: the ranks share "
                      "cores (gloo allows it), so every run is slower and time limits may need --process-timeout")
    return None, None


def unknown_ini_keys(config, known: set[str]) -> str | None:
    """A usage error for `conformance_*` keys in the pytest configuration that the suite does not
    read (pytest would only warn, and the run would test the bundled trainer instead)."""
    inicfg = getattr(config, "inicfg", {}) or {}
    unknown = sorted(k for k in inicfg if str(k).startswith("conformance_") and k not in known)
    if not unknown:
        return None
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    where = getattr(config, "inipath", None) or "the pytest configuration"
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
    return (f"{where}: unknown option {key!r}, which the conformance suite does not read ({hint})\n"
            f"  fix: {'rename it to ' + repr(close[0]) if close else 'remove it'}")
