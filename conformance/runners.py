"""Start trainer processes: uninterrupted, traced, or killed at a crash point.

A `Runner` is the only thing that launches trainers. `SubprocessRunner` starts a fresh interpreter
per process; `WarmRunner` forks them from a process that imported torch and the trainer once
(forkserver.py), for `python -m module` trainers run with the suite's own interpreter.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Protocol

from . import recording, strace
from .adapters import TrainerAdapter
from .process import ProcessResult, RunSpec, read_losses

POLL_S = 0.05


class ProcessOverran(Exception):
    """A trainer process broke a time or size limit and was killed; the message says which."""

    def __init__(self, problem: str, result: ProcessResult):
        super().__init__(problem)
        self.problem, self.result = problem, result


@dataclasses.dataclass(frozen=True)
class Limits:
    """How long one trainer process may run, how long it may go without logging a step, and how
    large its strace output may grow. Derived from the baseline's duration (see checks/session.py)."""

    total_s: float = 600.0
    stall_s: float = 120.0
    trace_bytes: int = int(os.environ.get("CONFORMANCE_TRACE_CAP", str(4 << 30)))


@dataclasses.dataclass(frozen=True)
class Stop:
    """A planned end for a process, besides its own exit: after it logs a step (it went on
    training past the point of interest), or a grace period after a SIGTERM reached it (what a
    scheduler does: SIGTERM, wait, SIGKILL)."""

    after_step: int | None = None
    grace_s: float | None = None


class Watchdog:
    """Reads the loss log (and the trace) as they grow and says when a process must be stopped,
    and why. `planned` is set when the stop was a planned one, not a broken limit."""

    def __init__(self, limits: Limits, spec: RunSpec, loss_log: Path, trace_file: Path | None,
                 stop: Stop | None = None):
        self.limits, self.spec, self.loss_log, self.trace_file = limits, spec, loss_log, trace_file
        self.stop = stop or Stop()
        self.start = self.progress_at = time.monotonic()
        self.offset, self.last_step, self.partial = 0, 0, b""
        self.planned: str | None = None
        self.signalled_at: float | None = None
        self.trace_offset = 0

    def _read_steps(self) -> None:
        try:
            with open(self.loss_log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if step > self.last_step or self.last_step == 0:
                self.progress_at = time.monotonic()
            self.last_step = max(self.last_step, step)

    def _signal_seen(self) -> bool:
        """Whether strace's output shows the SIGTERM delivered (it writes each line as it happens)."""
        if self.signalled_at is None and self.trace_file is not None:
            start = max(0, self.trace_offset - 32)   # a marker may straddle two reads
            try:
                with open(self.trace_file, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
            except OSError:
                return False
            self.trace_offset = start + len(chunk)
            if b"--- SIGTERM " in chunk:
                self.signalled_at = time.monotonic()
        return self.signalled_at is not None

    def problem(self) -> str | None:
        self._read_steps()
        now, total = time.monotonic(), self.spec.total_steps
        if self.stop.after_step is not None and self.last_step >= self.stop.after_step:
            self.planned = f"stopped by the suite after it logged step {self.last_step}"
            return self.planned
        if self.stop.grace_s is not None and self._signal_seen() and now - self.signalled_at > self.stop.grace_s:
            self.planned = f"SIGKILLed {self.stop.grace_s:g} s after SIGTERM (still running at the end of the grace period)"
            return self.planned
        if self.last_step > total:
            return f"ran past CONFORMANCE_TOTAL_STEPS (logged step {self.last_step} of {total})"
        if now - self.start > self.limits.total_s:
            return (f"did not finish {total} steps in {self.limits.total_s:.0f} s "
                    f"({f'logged up to step {self.last_step}' if self.last_step else 'logged no step'})")
        if now - self.progress_at > self.limits.stall_s:
            after = f"after step {self.last_step}" if self.last_step else "before logging any step"
            return f"made no progress for {self.limits.stall_s:.0f} s {after}"
        if self.trace_file is not None:
            try:
                size = self.trace_file.stat().st_size
            except OSError:
                size = 0
            if size > self.limits.trace_bytes:
                return f"its strace output grew past {self.limits.trace_bytes} bytes (CONFORMANCE_TRACE_CAP)"
        return None


class Runner(Protocol):
    """Runs one trainer process to its end and reports what it left; raises ProcessOverran if
    the process had to be stopped."""

    limits: Limits

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None,
                    stop: Stop | None = None) -> ProcessResult: ...

    def close(self) -> None: ...


def _trace_text(trace_file: Path | None) -> str:
    return trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""


def _finish(rc: int, err: str, loss_log: Path, trace_file: Path | None, start: float, overrun: str | None,
            watch: Watchdog) -> ProcessResult:
    planned = overrun is not None and overrun == watch.planned
    result = ProcessResult(rc, read_losses(loss_log), err, "" if overrun and not planned else _trace_text(trace_file),
                           seconds=time.monotonic() - start, overrun="" if planned else overrun or "",
                           stopped=(watch.planned or "") if planned else "")
    if overrun and not planned:
        raise ProcessOverran(overrun, result)
    return result


class SubprocessRunner:
    """One fresh interpreter per trainer process."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None,
                    stop: Stop | None = None) -> ProcessResult:
        argv = list(prefix or []) + list(adapter.argv)
        start = time.monotonic()
        watch = Watchdog(self.limits, spec, loss_log, trace_file, stop)
        err_path = loss_log.with_name(loss_log.name + ".stderr")
        with open(err_path, "w+b") as err_file:
            proc = subprocess.Popen(argv, env=adapter.environment(spec.env(ckpt_dir, loss_log)), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
            overrun = None
            while proc.poll() is None:
                overrun = watch.problem()
                if overrun:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                time.sleep(POLL_S)
            err_file.seek(0)
            err = err_file.read().decode(errors="replace")
        return _finish(proc.returncode, err, loss_log, trace_file, start, overrun, watch)

    def close(self) -> None:
        pass


class WarmRunner:
    """Forks trainer processes from a warm process that has imported torch and the trainer's
    module once (see forkserver.py). Trainers that are not `python -m module` with this
    interpreter fall back to a fresh interpreter."""

    def __init__(self, limits: Limits | None = None):
        self._servers: dict = {}
        self._fallback = SubprocessRunner()
        self._lock = threading.Lock()
        self.limits = limits or Limits()

    def _server(self, adapter: TrainerAdapter, target):
        from .forkserver import ForkServer
        with self._lock:
            key = (target.interpreter, target.kind, target.target, adapter.pythonpath)
            if key not in self._servers:
                preload = [target.target] if target.kind == "module" else script_imports(target.target)
                self._servers[key] = ForkServer(preload, env=adapter.environment(dict(os.environ)),
                                                interpreter=target.interpreter)
            return self._servers[key]

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None,
                    stop: Stop | None = None) -> ProcessResult:
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if target is None:
            self._fallback.limits = self.limits
            return self._fallback.run_process(adapter, spec, ckpt_dir, loss_log, prefix=prefix, trace_file=trace_file,
                                              stop=stop)
        stderr_path = loss_log.with_name(loss_log.name + ".stderr")
        attach = (lambda pid: attach_strace(prefix, pid)) if prefix else None
        start = time.monotonic()
        watch = Watchdog(self.limits, spec, loss_log, trace_file, stop)
        rc, overrun = self._server(adapter, target).run(target.target, list(target.argv),
                                                        adapter.environment(spec.env(ckpt_dir, loss_log)),
                                                        stderr_path, attach, watch=watch.problem, poll=POLL_S,
                                                        kind=target.kind)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return _finish(rc, err, loss_log, trace_file, start, overrun, watch)

    def run_twice(self, adapter: TrainerAdapter, first: RunSpec, second: RunSpec, ckpt_dir: Path,
                  first_log: Path, second_log: Path) -> ProcessResult | None:
        """Run the trainer with `first`, then again with `second` in the same process (only for
        trainers the fork server runs); the second run's result, or None if not possible."""
        from .forkserver import warm_target
        target, _ = warm_target(adapter)
        if target is None:
            return None
        stderr_path = second_log.with_name(second_log.name + ".stderr")
        start = time.monotonic()
        watch = Watchdog(dataclasses.replace(self.limits, stall_s=self.limits.total_s), second, second_log, None)
        rc, overrun = self._server(adapter, target).run(
            target.target, list(target.argv), adapter.environment(first.env(ckpt_dir, first_log)), stderr_path,
            watch=watch.problem, poll=POLL_S, then_env=adapter.environment(second.env(ckpt_dir, second_log)),
            kind=target.kind)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return _finish(rc, err, second_log, None, start, overrun, watch)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def script_imports(path: str) -> list[str]:
    """The modules a script imports at its top level: the fork server imports them once, as it
    imports a module trainer, so a forked child does not (a failing import is left to the child)."""
    import ast
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


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


def listing(directory: Path) -> frozenset[str]:
    """Every path under `directory`, relative to it."""
    return frozenset(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


def traced_run(runner: Runner, adapter: TrainerAdapter, spec: RunSpec, workdir: Path, *, tag: str = "baseline",
               prepare: Path | None = None, data: bool = False, trace: bool = True) -> recording.RecordedRun:
    """Run uninterrupted under strace: with `data`, a recording crash states can be rebuilt from.
    `prepare` is a checkpoint directory to start from (copied). Without `trace` (strace unusable
    here), the run's losses only: no operations."""
    ckpt = (workdir / f"{tag}-ckpt").resolve()
    if ckpt.exists():
        shutil.rmtree(ckpt)
    if prepare is not None:
        shutil.copytree(prepare, ckpt, symlinks=True)
    else:
        ckpt.mkdir(parents=True)
    before = listing(ckpt)
    log = (workdir / f"{tag}-loss.jsonl").resolve()
    log.unlink(missing_ok=True)
    trace_file = workdir / f"{tag}.strace"
    result = runner.run_process(adapter, spec, ckpt, log, prefix=strace.record_argv(trace_file, data=data)
                                if trace else None, trace_file=trace_file if trace else None)
    run = recording.build(strace.parse(result.trace_text), spec, result, ckpt, log, preexisting=before)
    result.trace_text = ""   # parsed: a recording's text can be large
    trace_file.unlink(missing_ok=True)
    return run
