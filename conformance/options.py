"""The suite's options in pytest: registered from the one table (model/flags.py) with their ini
keys and short spellings, how a value is read (the flag, else the ini key), and the checks of
values that are not a plain string."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest

from .model.flags import BY_NAME, FLAGS
from .model.settings import OLD_PROFILE_NAMES

OPTIONS = {f.name: (f.flag, f.ini_key) for f in FLAGS}   # name -> (command-line flag, ini key)
USAGE_PREFIX = "conformance usage error: "
DEFAULT_REPORT_DIR = "conformance-report"   # relative to the working directory: reports and plots outlive the run


def add_options(parser) -> None:
    """The suite's command-line options and their ini keys (the plugin's pytest_addoption), all in
    its own namespace: argparse shares dests between plugins, so those are namespaced too."""
    group = parser.getgroup("conformance", "resume-determinism conformance suite")
    for f in FLAGS:
        if f.kind == "switch":
            group.addoption(f.flag, dest=f.dest, action="store_true", default=False, help=f.help)
        else:
            group.addoption(f.flag, dest=f.dest, default=None, metavar=f.metavar, help=f.help,
                            **({"choices": f.choices} if f.choices else {}))
        if f.ini:
            parser.addini(f.ini_key, f"default for {f.flag}")


def add_short_spellings(parser) -> list[str]:
    """Register each option's short spelling (`--adapter`) as an alias, except a flag that another
    plugin or conftest registered by now: that one stays theirs (argparse would refuse both, and
    pytest would not start). Returns the short spellings left to others."""
    groups = [*parser._groups, parser._anonymous]
    claimed = {name for group in groups for opt in group.options for name in opt.names()}
    group = parser.getgroup("conformance")
    taken = []
    for f in FLAGS:
        if f.short is None:
            continue
        if f.short in claimed:
            taken.append(f.short)
            continue
        extra = {"action": "store_true"} if f.kind == "switch" else {"choices": f.choices} if f.choices else {}
        group.addoption(f.short, dest=f.dest, help=f"short for {f.flag}", **extra)
    return taken


def option(config, name: str):
    value = config.getoption(BY_NAME[name].dest)
    if value is None and BY_NAME[name].ini:
        value = config.getini(BY_NAME[name].ini_key) or None
    return value


def number(config, name: str, default: float | None) -> float | None:
    """A numeric option (seconds: positive; a tolerance: 0 or more), from the flag or the ini key;
    one usage error for a value that is not one, whichever way it was given."""
    value = option(config, name)
    if value is None:
        return default
    flag = BY_NAME[name]
    what = "a positive number of seconds" if flag.kind == "seconds" else "a number, 0 or more"
    try:
        number = float(value)
        if not (number > 0 if flag.kind == "seconds" else number >= 0) or number != number or number == float("inf"):
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"{USAGE_PREFIX}{flag.spelling} {value!r} is not {what}\n  fix: {flag.spelling}="
                                f"{'30' if flag.kind == 'seconds' else '1e-4'}, or leave it unset for the default") from None
    return number


def resume_interpreter(config) -> str | None:
    """--resume-python: an executable Python interpreter, as an absolute path; a usage error if not."""
    value = option(config, "resume_python")
    if value is None:
        return None
    found = shutil.which(os.path.expanduser(str(value)))
    if found is None:
        raise pytest.UsageError(f"{USAGE_PREFIX}--resume-python {value!r} is not an executable\n  fix: give the "
                                "interpreter of another environment, e.g. .venv-np126/bin/python")
    found = os.path.abspath(found)
    # An xdist worker's controller asked that environment before any worker started (configure).
    missing = None if hasattr(config, "workerinput") else _lacks_suite(found)
    if missing:
        raise pytest.UsageError(f"{USAGE_PREFIX}--resume-python {found}: that environment cannot import this suite "
                                f"({missing}); upgrade_resume starts its trainer processes there\n  fix: "
                                f"{found} -m pip install --no-deps {_install_spec()}")
    return found


@functools.cache
def _lacks_suite(interpreter: str) -> str | None:
    """Why `interpreter` cannot run the suite's trainer processes (its last error line), or None."""
    proc = subprocess.run([interpreter, "-c", "import conformance.run.child"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def _install_spec() -> str:
    """How another environment installs this very suite: its checkout, where it runs from one."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return f"-e {root}"
    from .model.settings import VERSION
    return f"resume-conformance=={VERSION}"


def rdzv_port(config) -> int | None:
    value = option(config, "rdzv_port")
    if value is None:
        return None
    try:
        port = int(value)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--rdzv-port {value!r} is not a TCP port (1-65535)\n  fix: give a free port, or "
                                "leave it unset for a free port per job") from None
    return port


def accept_old_profile_name(name: str | None) -> None:
    """`--hypothesis-profile=conformance-ci` (the suite's name before 0.2), where nothing else registered `ci`:
    Hypothesis gets that name as the suite's profile so that it loads; a team's own `ci` stays
    theirs. The suite's tests run under suite_profile() either way."""
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument
    if name in OLD_PROFILE_NAMES:
        try:
            settings.get_profile(name)
        except InvalidArgument:
            settings.register_profile(name, settings.get_profile(OLD_PROFILE_NAMES[name]))


PLATFORM = sys.platform


def platform_problem() -> str | None:
    """The suite runs trainers the Linux way (/proc, pidfd, SO_PEERCRED, real-time signals,
    strace): elsewhere, one usage error when it is asked to run, and nothing at all otherwise."""
    if PLATFORM.startswith("linux"):
        return None
    return (f"the conformance suite runs on Linux only (this is {PLATFORM}): it watches trainer processes through "
            "/proc, pidfd and strace\n  fix: run it on a Linux machine, in a Linux container (e.g. docker run "
            "--cap-add=SYS_PTRACE ...), or under WSL 2 on Windows")
