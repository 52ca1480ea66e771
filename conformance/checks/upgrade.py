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
import re
import subprocess
import sys

from ..model.adapters import TrainerAdapter
from ..model.process import ProcessResult, RunSpec
from ..run.forkserver import python_interpreter
from .common import resumed_from
from .failures import CheckNotApplicable, format_mismatches, loss_mismatches, stderr_tail
from .session import Session
from .tolerance import capped

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
    if python_interpreter(adapter.argv) is None:
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


@dataclasses.dataclass(frozen=True)
class _Environment:
    adapter: TrainerAdapter     # the trainer, started by this environment's interpreter
    name: str                   # how messages name it
    python: str

    def describe(self) -> str:
        return f"{self.name} ({versions(self.python)})"


def upgrade_resume(session: Session, check: str, spec: RunSpec, param: str, _case=None) -> None:
    case = {"resume_python": session.resume_python}
    here = _Environment(session.adapter, "the suite's interpreter", sys.executable)
    there = _Environment(in_environment(session.adapter, session.resume_python), session.resume_python,
                         session.resume_python)
    saver, resumer = (here, there) if param == "rollback" else (there, here)
    stop = spec.save_every * ((spec.total_steps - 1) // spec.save_every)
    if stop < 1:
        raise CheckNotApplicable(f"no save before step {spec.total_steps} to resume from")
    saved = session.run_once(spec.but(total_steps=stop), f"{param}-save", adapter=saver.adapter)
    where = f"  saved under {saver.describe()} up to step {stop}\n  resumed under {resumer.describe()}\n"
    if saved.result.returncode != 0:
        raise session.fail(check, spec, f"the run that saves, under {saver.name}, exited "
                           f"{saved.result.returncode}: {first_error(saved.result.stderr)}",
                           details=where + "  stderr:\n" + stderr_tail(saved.result.stderr), case=case)
    resumed = session.run_once(spec, f"{param}-resume", adapter=resumer.adapter, prepare=saved.ckpt_dir).result
    if resumed.returncode != 0:
        raise session.fail(check, spec, f"resumed under {resumer.name} from a checkpoint saved under "
                           f"{saver.name}, the trainer exited {resumed.returncode}: {first_error(resumed.stderr)}",
                           details=where + "  stderr:\n" + stderr_tail(resumed.stderr), case=case)
    r = resumed.resumed_from(spec)
    if r != stop:
        raise session.fail(check, spec, f"resumed under {resumer.name} {resumed_from(r)}, not from the checkpoint of "
                           f"step {stop} saved under {saver.name}: it refused or skipped it",
                           details=where + "  stderr:\n" + stderr_tail(resumed.stderr), case=case)
    baseline = session.baseline(spec) if resumer is here else session.other_baseline(spec, there.adapter)
    # Two environments may round differently (another torch or numpy build): the cap, not the noise
    # of one environment's runs, bounds what crossing between them may change.
    rows = loss_mismatches(baseline.losses, resumed.losses, capped(session.cap, "the state crosses into another "
                                                                   "environment, whose arithmetic may round differently"))
    if rows and not _same_as_own_resume(session, resumer.adapter, spec, stop, resumed, param):
        raise session.fail(check, spec, f"resumed under {resumer.name} from step {stop} (saved under "
                           f"{saver.name}), the losses differ from an uninterrupted run under "
                           f"{resumer.name} and from a resume saved there too: the checkpoint does not carry "
                           "its state across the change",
                           details=where + "  first differing steps:\n" + format_mismatches(rows), case=case)


def _same_as_own_resume(session: Session, adapter: TrainerAdapter, spec: RunSpec, stop: int,
                        resumed: ProcessResult, param: str) -> bool:
    """Whether a resume saved and resumed in the resuming environment alone gives the same losses."""
    own = session.run_once(spec.but(total_steps=stop), f"{param}-own-save", adapter=adapter)
    again = session.run_once(spec, f"{param}-own-resume", adapter=adapter, prepare=own.ckpt_dir).result
    return again.returncode == 0 and not loss_mismatches(again.losses, resumed.losses, session.cap) \
        and set(resumed.losses) <= set(again.losses)
