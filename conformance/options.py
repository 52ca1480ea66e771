"""The suite's options: each command-line flag with its ini key, how a value is read (the flag,
else the ini key), and the checks of values that are not a plain string."""
from __future__ import annotations

import os
import shutil

import pytest

from .model.settings import DEFAULT_GRACE_S, DEFAULT_HANG_TIMEOUT_S, DEFAULT_TOL

OPTIONS = {   # name -> (command-line flag, ini key): every flag in the suite's own namespace
    "adapter": ("--conformance-adapter", "conformance_adapter"),
    "trainer_cmd": ("--conformance-trainer-cmd", "conformance_trainer_cmd"),
    "runner": ("--conformance-runner", "conformance_runner"),
    "loss_tol": ("--conformance-loss-tol", "conformance_loss_tol"),
    "process_timeout": ("--conformance-process-timeout", "conformance_process_timeout"),
    "grace_seconds": ("--conformance-grace-seconds", "conformance_grace_seconds"),
    "cold_url": ("--conformance-cold-url", "conformance_cold_url"),
    "world_size": ("--conformance-world-size", "conformance_world_size"),
    "nnodes": ("--conformance-nnodes", "conformance_nnodes"),
    "rdzv_port": ("--conformance-rdzv-port", "conformance_rdzv_port"),
    "report": ("--conformance-report", "conformance_report"),
    "expected_failures": ("--conformance-expected-failures", "conformance_expected_failures"),
    "resume_python": ("--conformance-resume-python", "conformance_resume_python"),
    "hang_timeout": ("--conformance-hang-timeout", "conformance_hang_timeout"),
    "confirm": ("--conformance-confirm", "conformance_confirm"),
}
# The short spellings the suite had before, still accepted where no other plugin claims the same
# flag (`short_aliases`): they are rewritten to the namespaced ones before pytest parses them.
ALIASES = {"--adapter": "--conformance-adapter", "--trainer-cmd": "--conformance-trainer-cmd",
           "--runner": "--conformance-runner", "--loss-tol": "--conformance-loss-tol",
           "--process-timeout": "--conformance-process-timeout", "--grace-seconds": "--conformance-grace-seconds",
           "--cold-url": "--conformance-cold-url", "--world-size": "--conformance-world-size",
           "--nnodes": "--conformance-nnodes", "--rdzv-port": "--conformance-rdzv-port",
           "--expected-failures": "--conformance-expected-failures",
           "--expected-failures-lenient": "--conformance-expected-failures-lenient",
           "--resume-python": "--conformance-resume-python", "--hang-timeout": "--conformance-hang-timeout",
           "--confirm": "--conformance-confirm"}
USAGE_PREFIX = "conformance usage error: "
DEFAULT_REPORT_DIR = "conformance-report"   # relative to the working directory: reports and plots outlive the run


def add_options(parser) -> None:
    """The suite's command-line options and their ini keys (the plugin's pytest_addoption)."""
    group = parser.getgroup("conformance", "resume-determinism conformance suite")
    group.addoption("--conformance-adapter", dest="conformance_adapter", default=None,
                    help="Python adapter 'package.module:attribute' (default: the bundled reference trainer)")
    group.addoption("--conformance-trainer-cmd", dest="conformance_trainer_cmd", default=None,
                    help="command that starts the trainer following the command contract")
    group.addoption("--conformance-runner", dest="conformance_runner", choices=("warm", "fresh"), default=None,
                    help="warm: fork trainer processes from a process that imported torch once "
                         "(default); fresh: a new interpreter per process")
    group.addoption("--conformance-loss-tol", dest="conformance_loss_tol", type=float, default=None,
                    help=f"max absolute loss difference per step (default {DEFAULT_TOL:g})")
    group.addoption("--conformance-process-timeout", dest="conformance_process_timeout", type=float, default=None,
                    metavar="SECONDS",
                    help="kill a trainer process after this long (default: 10x the baseline run, at "
                         "least 60 s; 600 s for the first run); half of it without a new step also kills")
    group.addoption("--conformance-grace-seconds", dest="conformance_grace_seconds", type=float, default=None, metavar="SECONDS",
                    help=f"preemption: how long after SIGTERM the trainer may run before SIGKILL (default "
                         f"{DEFAULT_GRACE_S:g}; SLURM and Kubernetes default to 30)")
    group.addoption("--conformance-cold-url", dest="conformance_cold_url", default=None, metavar="URL",
                    help="capability cold_tier: 'file' (default: a directory beside each checkpoint directory) or "
                         "s3://bucket/prefix (the suite starts moto's S3 server on loopback for the run)")
    group.addoption("--conformance-world-size", dest="conformance_world_size", default=None, metavar="W",
                    help="run the trainer as W ranks under torchrun (default: the adapter's world_size, or 1)")
    group.addoption("--conformance-nnodes", dest="conformance_nnodes", default=None, metavar="N",
                    help="spread the W ranks over N torchrun agents on this machine, one per 'node', meeting "
                         "through c10d rendezvous (default: the adapter's nnodes, or 1)")
    group.addoption("--conformance-rdzv-port", dest="conformance_rdzv_port", default=None, metavar="PORT",
                    help="torchrun's rendezvous port for every job (default: a free port per job)")
    group.addoption("--conformance-report", dest="conformance_report", default=None, metavar="DIR",
                    help="write DIR/report.json (every check, its outcome and the numbers behind it), "
                         "DIR/summary.md (for a pull request) and DIR/plots/*.png (default: ./conformance-report)")
    group.addoption("--conformance-expected-failures", dest="conformance_expected_failures", default=None, metavar="FILE",
                    help="lines '<check id> : <reason>': those checks are expected to fail (strict)")
    group.addoption("--conformance-hang-timeout", dest="conformance_hang_timeout", type=float, default=None, metavar="SECONDS",
                    help=f"hang: how long a job may run after one of its ranks is stopped (SIGSTOP) before it "
                         f"counts as hung (default {DEFAULT_HANG_TIMEOUT_S:g}; the trainer is told a third of it in "
                         "CONFORMANCE_HANG_TIMEOUT)")
    group.addoption("--conformance-resume-python", dest="conformance_resume_python", default=None, metavar="PATH",
                    help="upgrade_resume: another environment's Python interpreter (another torch, numpy or "
                         "library version); checkpoints are saved in one and resumed in the other, both ways")
    group.addoption("--conformance-confirm", dest="conformance_confirm", choices=("fresh", "off"), default=None,
                    help="fresh (default): a failure found under the warm runner is replayed once in a fresh "
                         "interpreter per process before it is reported; when that passes, the run reports a runner "
                         "disagreement instead of failing the trainer. off: report what the warm runner found")
    group.addoption("--conformance-expected-failures-lenient", dest="conformance_expected_failures_lenient", action="store_true",
                    default=False,
                    help="a listed check that passes does not fail the run")
    for flag, ini in OPTIONS.values():
        parser.addini(ini, f"default for {flag}")


def short_aliases(args: list[str], claimed: set[str]) -> list[str]:
    """`args` with each of the suite's short spellings (ALIASES) written the namespaced way, unless
    another plugin registered that flag itself (`claimed`): then it is that plugin's."""
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        long = ALIASES.get(flag)
        out.append(long + eq + value if long and flag not in claimed else arg)
    return out


def option(config, name: str):
    flag, ini = OPTIONS[name]
    value = config.getoption(f"conformance_{name}")   # dests in the suite's namespace too: argparse shares them
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
