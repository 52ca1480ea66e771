"""Helpers the check families share: plots of diverging curves, and the files of a checkpoint."""
from __future__ import annotations

from pathlib import Path

from ..model import evidence
from ..model.crash import Schedule, format_schedule
from ..model.process import RunSpec, copy_checkpoint_dir
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
    """Regular files that the save of step `stop` wrote and that still exist after the run."""
    files: dict[str, None] = {}
    for i in prefix.windows().get(stop, []):
        op = prefix.ops[i]
        if op.kind == "rename":
            # A renamed directory (e.g. a temp dir committed as `ckpt-<step>`) carries its files.
            src, dst = op.path, op.target
            files = {(dst + p[len(src):] if p == src or p.startswith(src + "/") else p): None for p in files}
        if op.kind in ("write", "rename", "create", "link"):
            files[op.target if op.kind in ("rename", "link") else op.path] = None
    paths = [prefix.ckpt_dir / p for p in files if not p.startswith("/")]
    return [p for p in paths if p.is_file() and not p.is_symlink()]


def copy_prefix(session: Session, spec: RunSpec, name: str, check: str) -> tuple[Path, list[Path], int]:
    """A fresh copy of the prefix run's checkpoint directory, the files of its newest checkpoint
    in the copy, and that checkpoint's step."""
    prefix, stop = session.prefix(spec)
    d = session.case_dir(name)
    ckpt = (d / "ckpt").resolve()
    copy_checkpoint_dir(prefix.ckpt_dir, ckpt, spec.cold)
    files = [ckpt / p.relative_to(prefix.ckpt_dir) for p in newest_checkpoint_files(prefix, stop)]
    if not files:
        raise session.fail(check, spec, f"could not tell which files make up the checkpoint of step {stop}: "
                           "the save after logging that step wrote no file under CONFORMANCE_CKPT_DIR")
    return d, files, stop
