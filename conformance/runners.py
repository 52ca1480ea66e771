"""Start trainer processes: uninterrupted, traced, or killed at a crash point.

A `Runner` is the only thing that launches trainers. `SubprocessRunner` starts a fresh interpreter
per process; `WarmRunner` forks them from a process that imported torch and the trainer once
(forkserver.py), for `python -m module` trainers run with the suite's own interpreter.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Protocol

from . import recording, strace
from .adapters import TrainerAdapter
from .process import ProcessResult, RunSpec, read_losses

PROCESS_TIMEOUT_S = float(os.environ.get("CONFORMANCE_PROCESS_TIMEOUT", "300"))


class Runner(Protocol):
    """Runs one trainer process to its end and reports what it left."""

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None) -> ProcessResult: ...

    def close(self) -> None: ...


def _trace_text(trace_file: Path | None) -> str:
    return trace_file.read_text(errors="replace") if trace_file and trace_file.exists() else ""


class SubprocessRunner:
    """One fresh interpreter per trainer process."""

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None) -> ProcessResult:
        argv = list(prefix or []) + list(adapter.argv)
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, env=spec.env(ckpt_dir, loss_log), capture_output=True,
                                  text=True, timeout=PROCESS_TIMEOUT_S, stdin=subprocess.DEVNULL)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = -1, f"timed out after {PROCESS_TIMEOUT_S:.0f}s\n{exc.stderr or ''}"
        return ProcessResult(rc, read_losses(loss_log), err, _trace_text(trace_file),
                             seconds=time.monotonic() - start)

    def close(self) -> None:
        pass


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

    def run_process(self, adapter: TrainerAdapter, spec: RunSpec, ckpt_dir: Path, loss_log: Path, *,
                    prefix: list[str] | None = None, trace_file: Path | None = None) -> ProcessResult:
        from .forkserver import warm_module
        found = warm_module(adapter)
        if found is None:
            return self._fallback.run_process(adapter, spec, ckpt_dir, loss_log, prefix=prefix, trace_file=trace_file)
        module, argv = found
        stderr_path = loss_log.with_name(loss_log.name + ".stderr")
        attach = (lambda pid: attach_strace(prefix, pid)) if prefix else None
        start = time.monotonic()
        rc = self._server(module).run(module, argv, spec.env(ckpt_dir, loss_log), stderr_path, attach,
                                      timeout=PROCESS_TIMEOUT_S)
        err = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        return ProcessResult(rc, read_losses(loss_log), err, _trace_text(trace_file),
                             seconds=time.monotonic() - start)

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
