"""Run trainer processes: uninterrupted, traced, or killed at a crash point.

`SubprocessRunner` starts a fresh interpreter per process. It is the only place that launches
trainers, so a faster runner (forking from a warm process) can replace it behind `run_process`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

from .adapters import TrainerAdapter
from .crash import CrashPoint
from .tracing import Event, Trace, strace_prefix

PROCESS_TIMEOUT_S = float(os.environ.get("CONFORMANCE_PROCESS_TIMEOUT", "300"))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    total_steps: int
    save_every: int
    seed: int

    def env(self, ckpt_dir: Path, loss_log: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CONFORMANCE_CKPT_DIR": str(ckpt_dir),
                    "CONFORMANCE_TOTAL_STEPS": str(self.total_steps),
                    "CONFORMANCE_SAVE_EVERY": str(self.save_every),
                    "CONFORMANCE_SEED": str(self.seed),
                    "CONFORMANCE_LOSS_LOG": str(loss_log)})
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Writing .pyc files adds open/write calls to the first run only, which would shift the
        # per-thread syscall counts that crash points are addressed by.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env


@dataclasses.dataclass
class ProcessResult:
    returncode: int
    losses: dict[int, float]
    stderr: str
    trace_text: str = ""
    killed: bool = False

    @property
    def first_step(self) -> int | None:
        return min(self.losses) if self.losses else None


def read_losses(path: Path) -> dict[int, float]:
    """Parse the loss log; a torn last line (the process was killed mid-write) is ignored."""
    losses: dict[int, float] = {}
    if not path.exists():
        return losses
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            losses[int(rec["step"])] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue
    return losses


class SubprocessRunner:
    """One fresh interpreter per trainer process."""

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path,
                    *, prefix: list[str] | None = None, trace_file: Path | None = None) -> ProcessResult:
        argv = list(prefix or []) + list(adapter.argv)
        try:
            proc = subprocess.run(argv, env=spec.env(ckpt_dir, loss_log), capture_output=True,
                                  text=True, timeout=PROCESS_TIMEOUT_S, stdin=subprocess.DEVNULL)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = -1, f"timed out after {PROCESS_TIMEOUT_S:.0f}s\n{exc.stderr or ''}"
        trace_text = trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""
        return ProcessResult(rc, read_losses(loss_log), err, trace_text)


@dataclasses.dataclass
class Baseline:
    """An uninterrupted, traced run: the reference loss curve and the run's filesystem events."""

    spec: RunSpec
    result: ProcessResult
    events: list[Event]         # mutations under the checkpoint directory, in order
    targetable: list[bool]
    step_writes: dict[int, Event]  # step k -> the write that logged it
    ckpt_dir: Path
    trace: Trace
    _windows: dict[int, list[int]] | None = dataclasses.field(default=None, repr=False)

    def crash_points(self) -> list[int]:
        """Indices into `events` that a syscall-level injection can hit exactly."""
        return [i for i, ok in enumerate(self.targetable) if ok]

    @property
    def losses(self) -> dict[int, float]:
        return self.result.losses

    def save_windows(self) -> dict[int, list[int]]:
        """Step s -> indices (into `events`) of mutations between logging s and logging s+1."""
        if self._windows is None:
            windows: dict[int, list[int]] = {}
            bounds = sorted((ev.seq, step) for step, ev in self.step_writes.items())
            for i, ev in enumerate(self.events):
                owner = 0
                for seq, step in bounds:
                    if seq < ev.seq:
                        owner = step
                    else:
                        break
                windows.setdefault(owner, []).append(i)
            self._windows = windows
        return self._windows


def traced_run(runner, adapter: TrainerAdapter, spec: RunSpec, workdir: Path, *, tag: str = "baseline",
               prepare: Path | None = None) -> Baseline:
    """Run uninterrupted under strace (tracing only). `prepare` is a checkpoint dir to start from."""
    ckpt = (workdir / f"{tag}-ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    if prepare is not None:
        shutil.copytree(prepare, ckpt, symlinks=True)
    else:
        ckpt.mkdir(parents=True)
    log = (workdir / f"{tag}-loss.jsonl").resolve()
    log.unlink(missing_ok=True)
    trace_file = workdir / f"{tag}.strace"
    result = runner.run_process(adapter, spec, ckpt, log, prefix=strace_prefix(trace_file), trace_file=trace_file)
    trace = Trace.parse(result.trace_text)
    events = trace.under(ckpt)
    writes = trace.writes_to(log)
    step_writes = {}
    for step, ev in zip(sorted(result.losses), writes):
        step_writes[step] = ev
    return Baseline(spec, result, events, [trace.targetable(e) for e in events], step_writes, ckpt, trace)


def injection_for(point: CrashPoint, baseline: Baseline) -> tuple[tuple[str, int], Event] | None:
    """(syscall, nth) to inject for `point` in a process whose own uninterrupted trace is
    `baseline`, and the event it should land on. `fs:i` counts targetable mutations only and
    wraps around, so every drawn index names a real point. None if the point cannot be hit."""
    if point.kind == "step":
        ev = baseline.step_writes.get(point.index + 1)
        if ev is None or not baseline.trace.targetable(ev):
            return None
    else:
        points = baseline.crash_points()
        if not points:
            return None
        ev = baseline.events[points[point.index % len(points)]]
    return (ev.syscall, ev.nth), ev


class WarmRunner:
    """Forks trainer processes from a warm process that has imported torch and the trainer's
    module once (see forkserver.py). Trainers that are not `python -m module` with this
    interpreter fall back to a fresh interpreter."""

    def __init__(self):
        self._servers: dict = {}
        self._fallback = SubprocessRunner()
        self._lock = threading.Lock()

    def _server(self, module: str):
        from .forkserver import ForkServer
        with self._lock:
            if module not in self._servers:
                self._servers[module] = ForkServer([module])
            return self._servers[module]

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path,
                    *, prefix: list[str] | None = None, trace_file: Path | None = None) -> ProcessResult:
        from .forkserver import warm_module
        found = warm_module(adapter)
        if found is None:
            return self._fallback.run_process(adapter, spec, ckpt_dir, loss_log, prefix=prefix, trace_file=trace_file)
        module, argv = found
        stderr_path = loss_log.with_name(loss_log.name + ".stderr")
        attach = (lambda pid: attach_strace(prefix, pid)) if prefix else None
        rc = self._server(module).run(module, argv, spec.env(ckpt_dir, loss_log), stderr_path, attach,
                                      timeout=PROCESS_TIMEOUT_S)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        trace_text = trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""
        return ProcessResult(rc, read_losses(loss_log), err, trace_text)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def attach_strace(prefix: list[str], pid: int) -> subprocess.Popen:
    """Start strace on an existing (blocked) process and return once it is attached."""
    args = [a for a in prefix if a not in ("-qq", "--")] + ["-p", str(pid)]
    tracer = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    seen = []
    for line in tracer.stderr:
        seen.append(line)
        if "attached" in line:
            break
    else:
        tracer.wait()
        raise RuntimeError(f"strace could not attach to {pid}: {''.join(seen)[-500:]}")
    threading.Thread(target=tracer.stderr.read, daemon=True).start()
    return tracer
