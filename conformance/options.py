"""The suite's options: each command-line flag with its ini key, how a value is read (the flag,
else the ini key), and the checks of values that are not a plain string."""
from __future__ import annotations

import os
import shutil

import pytest

from .model.settings import DEFAULT_GRACE_S, DEFAULT_HANG_TIMEOUT_S, DEFAULT_TOL

OPTIONS = {   # name -> (command-line flag, ini key)
    "adapter": ("--adapter", "conformance_adapter"),
    "trainer_cmd": ("--trainer-cmd", "conformance_trainer_cmd"),
    "runner": ("--runner", "conformance_runner"),
    "loss_tol": ("--loss-tol", "conformance_loss_tol"),
    "process_timeout": ("--process-timeout", "conformance_process_timeout"),
    "grace_seconds": ("--grace-seconds", "conformance_grace_seconds"),
    "cold_url": ("--cold-url", "conformance_cold_url"),
    "world_size": ("--world-size", "conformance_world_size"),
    "nnodes": ("--nnodes", "conformance_nnodes"),
    "rdzv_port": ("--rdzv-port", "conformance_rdzv_port"),
    "report": ("--conformance-report", "conformance_report"),
    "expected_failures": ("--expected-failures", "conformance_expected_failures"),
    "resume_python": ("--resume-python", "conformance_resume_python"),
    "hang_timeout": ("--hang-timeout", "conformance_hang_timeout"),
    "confirm": ("--confirm", "conformance_confirm"),
}
USAGE_PREFIX = "conformance usage error: "
DEFAULT_REPORT_DIR = "conformance-report"   # relative to the working directory: reports and plots outlive the run


def add_options(parser) -> None:
    """The suite's command-line options and their ini keys (the plugin's pytest_addoption)."""
    group = parser.getgroup("conformance", "resume-determinism conformance suite")
    group.addoption("--adapter", default=None,
                    help="Python adapter 'package.module:attribute' (default: the bundled reference trainer)")
    group.addoption("--trainer-cmd", default=None,
                    help="command that starts the trainer following the command contract")
    group.addoption("--runner", choices=("warm", "fresh"), default=None,
                    help="warm: fork trainer processes from a process that imported torch once "
                         "(default); fresh: a new interpreter per process")
    group.addoption("--loss-tol", type=float, default=None,
                    help=f"max absolute loss difference per step (default {DEFAULT_TOL:g})")
    group.addoption("--process-timeout", type=float, default=None, metavar="SECONDS",
                    help="kill a trainer process after this long (default: 10x the baseline run, at "
                         "least 60 s; 600 s for the first run); half of it without a new step also kills")
    group.addoption("--grace-seconds", type=float, default=None, metavar="SECONDS",
                    help=f"preemption: how long after SIGTERM the trainer may run before SIGKILL (default "
                         f"{DEFAULT_GRACE_S:g}; SLURM and Kubernetes default to 30)")
    group.addoption("--cold-url", default=None, metavar="URL",
                    help="capability cold_tier: 'file' (default: a directory beside each checkpoint directory) or "
                         "s3://bucket/prefix (the suite starts moto's S3 server on loopback for the run)")
    group.addoption("--world-size", default=None, metavar="W",
                    help="run the trainer as W ranks under torchrun (default: the adapter's world_size, or 1)")
    group.addoption("--nnodes", default=None, metavar="N",
                    help="spread the W ranks over N torchrun agents on this machine, one per 'node', meeting "
                         "through c10d rendezvous (default: the adapter's nnodes, or 1)")
    group.addoption("--rdzv-port", default=None, metavar="PORT",
                    help="torchrun's rendezvous port for every job (default: a free port per job)")
    group.addoption("--conformance-report", default=None, metavar="DIR",
                    help="write DIR/report.json (every check, its outcome and the numbers behind it), "
                         "DIR/summary.md (for a pull request) and DIR/plots/*.png (default: ./conformance-report)")
    group.addoption("--expected-failures", default=None, metavar="FILE",
                    help="lines '<check id> : <reason>': those checks are expected to fail (strict)")
    group.addoption("--hang-timeout", type=float, default=None, metavar="SECONDS",
                    help=f"hang: how long a job may run after one of its ranks is stopped (SIGSTOP) before it "
                         f"counts as hung (default {DEFAULT_HANG_TIMEOUT_S:g}; the trainer is told a third of it in "
                         "CONFORMANCE_HANG_TIMEOUT)")
    group.addoption("--resume-python", default=None, metavar="PATH",
                    help="upgrade_resume: another environment's Python interpreter (another torch, numpy or "
                         "library version); checkpoints are saved in one and resumed in the other, both ways")
    group.addoption("--confirm", choices=("fresh", "off"), default=None,
                    help="fresh (default): a failure found under the warm runner is replayed once in a fresh "
                         "interpreter per process before it is reported; when that passes, the run reports a runner "
                         "disagreement instead of failing the trainer. off: report what the warm runner found")
    group.addoption("--expected-failures-lenient", action="store_true", default=False,
                    help="a listed check that passes does not fail the run")
    for flag, ini in OPTIONS.values():
        parser.addini(ini, f"default for {flag}")


def option(config, name: str):
    flag, ini = OPTIONS[name]
    value = config.getoption(flag)
    if value is None:
        value = config.getini(ini) or None
    return value


def resume_interpreter(config) -> str | None:
    """--resume-python: an executable Python interpreter, as an absolute path; a usage error if not."""
    value = option(config, "resume_python")
    if value is None:
        return None
    found = shutil.which(os.path.expanduser(str(value)))
    if found is None:
        raise pytest.UsageError(f"{USAGE_PREFIX}--resume-python {value!r} is not an executable\n  fix: give the "
                                "interpreter of another environment, e.g. .venv-np126/bin/python")
    return os.path.abspath(found)


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


def positive_seconds(config, name: str, default: float) -> float:
    """A number of seconds option (e.g. --hang-timeout): positive, else a usage error."""
    value = option(config, name)
    if value is None:
        return default
    try:
        seconds = float(value)
        if not seconds > 0:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"{USAGE_PREFIX}{OPTIONS[name][0]} {value!r} is not a positive number of seconds") \
            from None
    return seconds
