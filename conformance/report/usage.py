"""What the first screen of a run says: which trainer, profile, runner and strace are in use, and
the usage mistakes caught before any test runs (each one error: a cause and a fix)."""
from __future__ import annotations

import difflib
import functools
import os
import shutil
import subprocess

from ..model.adapters import TrainerAdapter
from ..model.settings import GATE_PROFILE, OLD_PROFILE_NAMES, PROFILE_USES, suite_profile
from ..run.attach import attach_problem
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
    refused = attach_problem() if target is not None and adapter.has("syscall_crash") and not strace_problem() \
        else None
    if refused:
        return "fresh", (f"strace cannot attach to a running process here ({refused}), as the warm runner's tracing "
                         "needs (docs/running.md, \"Where ptrace is restricted\"), so every trainer process starts a new "
                         "interpreter and imports torch again (seconds each)")
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
    ranks += f" on {adapter.nnodes} nodes (c10d rendezvous)" if adapter.nnodes > 1 else ""
    selected = settings.get_current_profile_name()
    profile = suite_profile(selected) + ("" if suite_profile(selected) in (selected, OLD_PROFILE_NAMES.get(selected))
                                         else f" (for the suite's tests; {selected!r} is not one of its profiles)")
    return (f"conformance: trainer {adapter.name} ({adapter.spec}){ranks}, profile "
            f"{profile}, runner {runner} ({why}), strace {version or '-'} "
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


def ini_keys(inipath) -> set[str]:
    """The keys of pytest's section in its configuration file (pytest.ini, tox.ini, setup.cfg or
    pyproject.toml), read from the file itself: pytest lists them only through the deprecated
    `config.inicfg`."""
    import configparser
    from pathlib import Path
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10: pytest.ini, tox.ini and setup.cfg only
        tomllib = None
    if not inipath or (tomllib is None and str(inipath).endswith(".toml")):
        return set()
    path = Path(inipath)
    try:
        if path.suffix == ".toml":
            tool = tomllib.loads(path.read_text()).get("tool", {}).get("pytest", {})
            section = tool.get("ini_options", tool)
            return {str(k) for k in section if not isinstance(section[k], dict)}
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(path.read_text())
        for name in ("pytest", "tool:pytest"):
            if parser.has_section(name):
                return set(parser.options(name))
    except (OSError, ValueError, configparser.Error):
        pass
    return set()


def unknown_ini_keys(config, known: set[str]) -> str | None:
    """A usage error for `conformance_*` keys in the pytest configuration that the suite does not
    read (pytest would only warn, and the run would test the bundled trainer instead)."""
    unknown = sorted(k for k in ini_keys(config.inipath) if k.startswith("conformance_") and k not in known)
    if not unknown:
        return None
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    where = getattr(config, "inipath", None) or "the pytest configuration"
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
    return (f"{where}: unknown option {key!r}, which the conformance suite does not read ({hint})\n"
            f"  fix: {'rename it to ' + repr(close[0]) if close else 'remove it'}")



def profile_problem(name: str | None) -> str | None:
    """A usage error for a --hypothesis-profile that is not registered (Hypothesis itself would stop
    the run with an INTERNALERROR and a traceback)."""
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument
    if not name or name in OLD_PROFILE_NAMES:
        return None
    try:
        settings.get_profile(name)
        return None
    except InvalidArgument:
        pass
    names = {**{p: p for p in PROFILE_USES}, **OLD_PROFILE_NAMES}   # an old short name's typo finds the new name
    close = [names[c] for c in difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)]
    listed = "; ".join(f"{p} ({use})" for p, use in PROFILE_USES.items())
    return (f"--hypothesis-profile={name!r} is not a registered Hypothesis profile. The suite's profiles: {listed}\n"
            f"  fix: --hypothesis-profile={close[0] if close else GATE_PROFILE}")


# The ways of naming the trainer: the option's name (as in the plugin's OPTIONS), the environment
# variable a user may expect it to be read from, and what a value looks like.
TRAINER_NAMES = (("adapter", "CONFORMANCE_ADAPTER", "package.module:attribute"),
                 ("trainer_cmd", "CONFORMANCE_TRAINER_CMD", "COMMAND"))


def trainer_naming_problem(named: dict[str, str | None], options: dict[str, tuple[str, str]], environ) -> str | None:
    """A usage error where the run would silently test the bundled reference trainer instead of the one
    the user meant: an empty --adapter or --trainer-cmd, or the trainer named in an environment variable
    that the suite does not read. `named`: each option's value (flag or ini, None if unset); `options`:
    each option's (flag, ini key)."""
    for name, _, example in TRAINER_NAMES:
        value, flag = named[name], options[name][0]
        if value is not None and not str(value).strip():
            return (f"{flag} is empty, so the run would test the bundled reference trainer instead of yours\n"
                    f"  fix: {flag}={example} (or leave the option out to test the bundled trainer on purpose)")
    if all(named[name] is None for name, _, _ in TRAINER_NAMES):
        for name, variable, _ in TRAINER_NAMES:
            flag, ini = options[name]
            if environ.get(variable):
                return (f"{variable} is set, but the suite takes the trainer only from {flag} or the ini key "
                        f"{ini}; without them this run would test the bundled reference trainer\n"
                        f"  fix: {flag}=\"${variable}\" (or set {ini} in the pytest configuration)")
    return None
