"""upgrade_resume[rollback|upgrade]: checkpoints cross a dependency change. `--resume-python=PATH`
names another environment (another torch, numpy, transformers or trainer library version):
`rollback` saves under the suite's interpreter and resumes under PATH, `upgrade` saves under PATH
and resumes under the suite's.

The resume must match the baseline of the environment that resumes (a newer numpy may draw other
numbers, so each side is compared with its own uninterrupted run), or at least a resume from the
same step within that environment: a resume that diverges there too is resume_matches_baseline's
finding. A refusal or a crash fails, with its first error line.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys

from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec
from ..run.runners import traced_run
from .failures import CheckNotApplicable, format_mismatches, loss_mismatches, stderr_tail
from .session import Session

PARAMS = ("rollback", "upgrade")
_VERSIONS = ("import importlib.metadata as m, sys\n"
             "out = ['python ' + sys.version.split()[0]]\n"
             "for name in ('torch', 'numpy', 'transformers', 'lightning', 'accelerate'):\n"
             "    try:\n"
             "        out.append(name + ' ' + m.version(name))\n"
             "    except m.PackageNotFoundError:\n"
             "        pass\n"
             "print(', '.join(out))\n")


def in_environment(adapter: TrainerAdapter, python: str) -> TrainerAdapter:
    """The same trainer started by another interpreter; CheckNotApplicable if its command does not
    start with a Python interpreter."""
    exe = shutil.which(adapter.argv[0]) if adapter.argv else None
    if exe is None or not os.path.basename(exe).startswith("python"):
        raise CheckNotApplicable(f"the trainer command does not start a Python interpreter ({' '.join(adapter.argv[:2])}),"
                                 " so it cannot be started in another environment")
    return dataclasses.replace(adapter, argv=(python,) + tuple(adapter.argv[1:]))


@functools.cache
def versions(python: str) -> str:
    """What an interpreter imports: python, torch, numpy and the training libraries it has."""
    try:
        done = subprocess.run([python, "-c", _VERSIONS], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(not readable: {exc})"
    return done.stdout.strip() or f"(not readable: {stderr_tail(done.stderr, 1).strip()})"


def first_error(stderr: str) -> str:
    """The line that names the error (the last `SomethingError: ...` line), else the last line."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)   # colour codes some libraries print
    lines = [line.strip() for line in plain.strip().splitlines() if line.strip()]
    named = [line for line in lines if ("Error" in line or "Exception" in line) and ":" in line]
    return (named or lines or ["(no stderr)"])[-1][:300]


def upgrade_resume(session: Session, check: str, spec: RunSpec, param: str, _case=None) -> None:
    case = {"resume_python": session.resume_python}
    here = session.adapter
    there = in_environment(here, session.resume_python)
    saver, resumer = (here, there) if param == "rollback" else (there, here)
    names = {id(here): "the suite's interpreter", id(there): session.resume_python}
    stop = spec.save_every * ((spec.total_steps - 1) // spec.save_every)
    if stop < 1:
        raise CheckNotApplicable(f"no save before step {spec.total_steps} to resume from")
    saved = _run(session, saver, spec.but(total_steps=stop), f"{param}-save", None)
    pythons = {id(here): sys.executable, id(there): session.resume_python}
    where = (f"  saved under {names[id(saver)]} ({versions(pythons[id(saver)])}) up to step {stop}\n"
             f"  resumed under {names[id(resumer)]} ({versions(pythons[id(resumer)])})\n")
    if saved.result.returncode != 0:
        raise session.fail(check, spec, f"the run that saves, under {names[id(saver)]}, exited "
                           f"{saved.result.returncode}: {first_error(saved.result.stderr)}",
                           details=where + "  stderr:\n" + stderr_tail(saved.result.stderr), case=case)
    resumed = _run(session, resumer, spec, f"{param}-resume", saved.ckpt_dir).result
    if resumed.returncode != 0:
        raise session.fail(check, spec, f"resumed under {names[id(resumer)]} from a checkpoint saved under "
                           f"{names[id(saver)]}, the trainer exited {resumed.returncode}: {first_error(resumed.stderr)}",
                           details=where + "  stderr:\n" + stderr_tail(resumed.stderr), case=case)
    r = resumed.resumed_from(spec)
    if r != stop:
        raise session.fail(check, spec, f"resumed under {names[id(resumer)]} {_from(r)}, not from the checkpoint of "
                           f"step {stop} saved under {names[id(saver)]}: it refused or skipped it",
                           details=where + "  stderr:\n" + stderr_tail(resumed.stderr), case=case)
    baseline = session.baseline(spec).losses if resumer is here else session.other_baseline(spec, there).losses
    rows = loss_mismatches(baseline, resumed.losses, session.tol)
    if rows and not _same_as_own_resume(session, resumer, spec, stop, resumed, param):
        raise session.fail(check, spec, f"resumed under {names[id(resumer)]} from step {stop} (saved under "
                           f"{names[id(saver)]}), the losses differ from an uninterrupted run under "
                           f"{names[id(resumer)]} and from a resume saved there too: the checkpoint does not carry "
                           "its state across the change",
                           details=where + "  first differing steps:\n" + format_mismatches(rows), case=case)


def _from(step: int) -> str:
    return "from scratch" if step == 0 else f"from step {step}" if step > 0 else "without training"


def _run(session: Session, adapter: TrainerAdapter, spec: RunSpec, tag: str, prepare):
    return traced_run(session.runner, adapter, spec, session.case_dir(tag), tag=tag, prepare=prepare, trace=False)


def _same_as_own_resume(session: Session, adapter: TrainerAdapter, spec: RunSpec, stop: int,
                        resumed: ProcessResult, param: str) -> bool:
    """Whether a resume saved and resumed in the resuming environment alone gives the same losses."""
    own = _run(session, adapter, spec.but(total_steps=stop), f"{param}-own-save", None)
    again = _run(session, adapter, spec, f"{param}-own-resume", own.ckpt_dir).result
    return again.returncode == 0 and not loss_mismatches(again.losses, resumed.losses, session.tol) \
        and set(resumed.losses) <= set(again.losses)
