"""The suite's options, one typed table: it feeds pytest's command-line options and ini keys
(conformance/options.py), `python -m conformance replay`'s parser, the replay line of every failure
(the options that change a verdict) and the options table in docs/running.md.

Every option is spelled `--conformance-<name>` (ini key `conformance_<name>`); the short spelling
(`--adapter`) is an alias wherever no other plugin registered the same flag."""
from __future__ import annotations

from dataclasses import dataclass

from .settings import DEFAULT_GRACE_S, DEFAULT_HANG_TIMEOUT_S, DEFAULT_TOL, REPLAYS_PER_RUNNER


@dataclass(frozen=True)
class Flag:
    name: str               # dest `conformance_<name>`, ini key `conformance_<name>`
    help: str
    short: str | None       # the spelling before 0.2, kept as an alias where unambiguous
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    kind: str = "text"      # text | seconds (a positive number) | tolerance (a number >= 0) | count | switch | names
    verdict: bool = False   # changes a verdict: printed in the replay line, accepted by `replay`
    ini: bool = True        # has an ini key (a switch only lives on the command line)
    replayed: bool = False  # the trainer's own replay arguments carry it (TrainerAdapter.replay_args); `replay` accepts it

    @property
    def in_replay_line(self) -> bool:
        return self.verdict or self.replayed

    @property
    def flag(self) -> str:
        return f"--conformance-{self.name.replace('_', '-')}"

    @property
    def ini_key(self) -> str:
        return f"conformance_{self.name}"

    @property
    def dest(self) -> str:
        return f"conformance_{self.name}"

    @property
    def spelling(self) -> str:
        """How the docs and a replay line write it: the short spelling where there is one."""
        return self.short or self.flag


FLAGS = (
    Flag("adapter", "Python adapter 'package.module:attribute' (default: the bundled reference trainer)",
         "--adapter", "SPEC"),
    Flag("trainer_cmd", "command that starts the trainer following the command contract", "--trainer-cmd", "CMD"),
    Flag("capabilities", "a trainer command's capabilities, comma-separated names of conformance.Capability (e.g. "
         "extendable,resume_from), added to syscall_crash, which it always has; a Python adapter declares its own, and "
         "giving both is a usage error", "--capabilities", "NAMES", kind="names", replayed=True),
    Flag("carry_env", "environment variables that choose the trainer's variant, comma-separated: a failure's replay "
         "line sets each as this run had it (env NAME=VALUE python -m conformance replay ...) and names the likely ones "
         "it leaves out; CONFORMANCE_ variables are the suite's own, never carried", "--carry-env", "NAMES",
         kind="names", replayed=True),
    Flag("runner", "warm: fork trainer processes from a process that imported torch once (default); fresh: a new "
         "interpreter per process", "--runner", choices=("warm", "fresh")),
    Flag("loss_tol", f"largest absolute per-step loss difference accepted (default {DEFAULT_TOL:g}); a cap, the "
         "trainer's own noise decides below it", "--loss-tol", "X", kind="tolerance", verdict=True),
    Flag("process_timeout", "kill a trainer process after this long (default: 10x the baseline run, at least 60 s; "
         "600 s for the first run); half of it without a new step also kills", "--process-timeout", "SECONDS",
         kind="seconds", verdict=True),
    Flag("grace_seconds", f"preemption, interrupt: SIGKILL this long after SIGTERM or SIGINT (default "
         f"{DEFAULT_GRACE_S:g}; SLURM and Kubernetes default to 30), not counting time the trainer waited for a CPU",
         "--grace-seconds", "SECONDS", kind="seconds", verdict=True),
    Flag("hang_timeout", f"hang: how long a job may run after one of its ranks is stopped (SIGSTOP) before it counts "
         f"as hung (default {DEFAULT_HANG_TIMEOUT_S:g}; the trainer is told a third of it in CONFORMANCE_HANG_TIMEOUT)",
         "--hang-timeout", "SECONDS", kind="seconds", verdict=True),
    Flag("cold_url", "capability cold_tier: 'file' (default: a directory beside each checkpoint directory) or "
         "s3://bucket/prefix (the suite starts moto's S3 server on loopback for the run)", "--cold-url", "URL",
         verdict=True),
    Flag("resume_python", "upgrade_resume: another environment's Python interpreter (another torch, numpy or library "
         "version); checkpoints are saved in one and resumed in the other, both ways", "--resume-python", "PATH",
         verdict=True),
    Flag("world_size", "run the trainer as W ranks under torchrun (default: the adapter's world_size, or 1)",
         "--world-size", "W", kind="count"),
    Flag("nnodes", "spread the W ranks over N torchrun agents on this machine, one per 'node', meeting through c10d "
         "rendezvous (default: the adapter's nnodes, or 1)", "--nnodes", "N", kind="count"),
    Flag("rdzv_port", "torchrun's rendezvous port for every job (default: a free port per job)", "--rdzv-port",
         "PORT"),
    Flag("report", "write DIR/report.json (every check, its outcome and the numbers behind it), DIR/summary.md (for "
         "a pull request) and DIR/plots/*.png (default: ./conformance-report)", None, "DIR"),
    Flag("expected_failures", "lines '<check id> : <reason>': those checks are expected to fail (strict)",
         "--expected-failures", "FILE"),
    Flag("expected_failures_lenient", "a listed check that passes does not fail the run",
         "--expected-failures-lenient", kind="switch", ini=False),
    Flag("confirm", "fresh (default): a failure found under the warm runner is replayed in a fresh interpreter per "
         "process before it is reported; when that passes, "
         f"{REPLAYS_PER_RUNNER} more times in each runner: a failure that comes back in "
         "either fails as intermittent, one that never does as not reproducible, and only one that every warm run "
         "repeats and no fresh replay does is a runner disagreement instead of the trainer's failure. off: report "
         "what the warm runner found", "--confirm", choices=("fresh", "off")),
)
BY_NAME = {f.name: f for f in FLAGS}


DEFAULTS = {"loss_tol": DEFAULT_TOL, "grace_seconds": DEFAULT_GRACE_S, "hang_timeout": DEFAULT_HANG_TIMEOUT_S,
            "cold_url": "file"}


def replay_settings(**values: object) -> tuple[str, ...]:
    """The verdict-changing options whose value differs from its default, as replay arguments
    (`--grace-seconds=30`): a replay line with them replays the run that failed (a failure found
    with a 30 s grace replays with 30 s)."""
    out = []
    for flag in FLAGS:
        value = values.get(flag.name)
        if flag.verdict and value is not None and value != DEFAULTS.get(flag.name):
            out.append(f"{flag.spelling}={value:g}" if isinstance(value, float) else f"{flag.spelling}={value}")
    return tuple(out)


def markdown_table() -> str:
    """docs/running.md's options table."""
    rows = ["| option | short spelling | ini key | meaning |", "|---|---|---|---|"]
    for f in FLAGS:
        value = f"={'|'.join(f.choices)}" if f.choices else (f"={f.metavar}" if f.metavar else "")
        value = value.replace("|", "\\|")
        short = f"`{f.short}`" if f.short else ""
        ini = f"`{f.ini_key}`" if f.ini else ""
        rows.append(f"| `{f.flag}{value}` | {short} | {ini} | {f.help}{' (in the replay line)' if f.in_replay_line else ''} |")
    rows.append("| `--hypothesis-profile=conformance-quick\\|conformance-ci\\|conformance-fuzz` | | | Hypothesis's own "
                "option: how many crash schedules are drawn (below) |")
    return "\n".join(rows)
