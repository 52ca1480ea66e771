"""Helpers the check families share: plots of diverging curves, and the files of a checkpoint."""
from __future__ import annotations

from pathlib import Path

from ..faults.injection import FaultOutcome, run_fault
from ..model import evidence
from ..model.crash import CrashPoint, Schedule, format_schedule
from ..model.process import RunSpec, copy_checkpoint_dir
from ..offline.crash_states import save_files, save_paths, with_stand_in_bytes
from ..run.runners import Stop
from ..run.watchdog import grace_expired
from ..trace.recording import RecordedRun
from .plots import plot_name, plot_resume
from .session import Session


def resumed_from(step: int) -> str:
    """How a failure message says where a start resumed: "from scratch" or "from step k"."""
    return "from scratch" if step == 0 else f"from step {step}"


def plot_mismatch(session: Session, check: str, spec: RunSpec, *, schedule: Schedule | None = None,
                  extra: str = "", resumed: list[tuple[str, dict[int, float]]],
                  crashes: list[tuple[str, float]] = (), resumes: list[int] = ()) -> str:
    """Plot baseline vs resumed curves; returns the failure-message line naming the PNG."""
    if session.verdict_only:
        return "  plot:     not drawn (a confirmation replay)"
    path = session.plot_dir / plot_name(check, session.adapter.name, schedule, extra)
    title = (f"[{check}] {session.adapter.name}  {spec.describe()}"
             + (f"  schedule {format_schedule(schedule)}" if schedule is not None else "")
             + (f"  {extra}" if extra else ""))
    try:
        written = plot_resume(path, title=title, baseline=session.baseline(spec).losses, resumed=resumed,
                              crashes=list(crashes), resumes=list(resumes))
    except Exception as exc:  # a plot must never hide the verdict
        written = f"not written: {exc!r}"
    if isinstance(written, Path):
        evidence.record(evidence.Plot(str(written)))
    return f"  plot:     {written}"


def newest_checkpoint_files(prefix: RecordedRun, stop: int) -> list[Path]:
    """Regular files of the checkpoint of step `stop` (crash_states.save_files, asked of the prefix
    run recorded for paths only) that still exist after the run, in the order its save first put
    them (crash_states.save_paths)."""
    files = save_files(with_stand_in_bytes(prefix)).get(stop, {})
    order = {p: i for i, p in enumerate(save_paths(prefix).get(stop, ()))}
    paths = [prefix.ckpt_dir / p for p in sorted(files, key=lambda p: order.get(p, len(order)))]
    return [p for p in paths if p.is_file() and not p.is_symlink()]


def copy_prefix(session: Session, spec: RunSpec, name: str, check: str, stop: int | None = None
                ) -> tuple[Path, list[Path], int]:
    """A fresh copy of the prefix run's checkpoint directory (stopped after the save of `stop`, by
    default the last before the end), the files of its newest checkpoint in the copy, and that
    checkpoint's step."""
    prefix, stop = session.prefix(spec, stop)
    d = session.case_dir(name)
    ckpt = (d / "ckpt").resolve()
    copy_checkpoint_dir(prefix.ckpt_dir, ckpt, spec.cold)
    # The prefix run is recorded once and its directory only ever copied: one answer per copy.
    newest = session._cached(("newest-checkpoint-files", spec, stop), lambda: newest_checkpoint_files(prefix, stop))
    files = [ckpt / p.relative_to(prefix.ckpt_dir) for p in newest]
    if not files:
        raise session.fail(check, spec, f"could not tell which files make up the checkpoint of step {stop}: "
                           "the save after logging that step wrote no file under CONFORMANCE_CKPT_DIR")
    return d, files, stop


def signal_fault(session: Session, check: str, spec: RunSpec, point: CrashPoint, stop: Stop, *,
                 faulted_spec: RunSpec | None = None) -> tuple[FaultOutcome, str]:
    """A signal (`stop.signal`: TERM, INT, STOP) delivered at `point`, then a fresh start; the
    outcome, recorded as evidence, and the `fault:` line its failure message starts with."""
    name = f"SIG{stop.signal}"
    outcome = run_fault(session.runner, session.adapter, spec, point, f"signal={stop.signal}",
                        session.case_dir(name.lower()), session.baseline(spec), stop=stop,
                        stable=session.stable_paths(spec), faulted_spec=faulted_spec)
    kill, first = outcome.planned, outcome.first
    # went on: still running when the suite stopped it (for a frozen rank: at the end of --hang-timeout)
    went_on = grace_expired(first.stopped) if stop.signal == "STOP" else bool(first.stopped)
    evidence.record(evidence.Fault(check=check, point=str(point), planned=kill.text, fault=name,
                                   first_exit=first.returncode, went_on=went_on, resumed_from=outcome.resumed_from,
                                   final_exit=outcome.final.returncode))
    where = (f"  fault: {name} at {kill.text}" + (f", inside the save of step {kill.in_progress}" if kill.in_progress
                                                  else "") + f"; newest committed checkpoint then: step "
             f"{kill.newest_committed}\n")
    return outcome, where
