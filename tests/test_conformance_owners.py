"""One owner per fact: which files belong to a checkpoint (offline/crash_states.py: save_paths,
save_files), asked by the newest checkpoint's files (checks/common.py), retention (offline/retained.py)
and corruption_detected (checks/damage.py) instead of three rules of their own; and reshard's kill
(checks/ranks.py) landing on the loss log like every step point (faults/delivery.py) and proven to."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.checks import ranks
from conformance.checks.common import newest_checkpoint_files
from conformance.checks.damage import fallback_step, saves_held
from conformance.faults.delivery import CrashNotLanded
from conformance.model import evidence
from conformance.model.process import ProcessResult, RunSpec, rank_log
from conformance.offline import retained
from conformance.offline.crash_states import save_files, save_paths, with_stand_in_bytes
from conformance.trace import recording, strace
from conformance.trace.recording import Op, RecordedRun

FLAGS = "O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC"


def run_of(*ops: Op, ckpt_dir: Path = Path("/run/ck")) -> RecordedRun:
    """A single-threaded run of `ops`: each belongs to the save of the step logged before it."""
    ops = tuple(dataclasses.replace(op, index=i, save=op.after_step) for i, op in enumerate(ops))
    return RecordedRun(RunSpec(9, 3, 0), ProcessResult(0, {}, ""), ckpt_dir, ops, {}, frozenset())


def put(step: int, path: str, data: bytes | None, *, fd: int = 4, stage: str = "") -> list[Op]:
    """A file written (through `stage` when given, then renamed to `path`) in the save of `step`."""
    at = stage or path
    ops = [Op(0, "create", at, fd=fd, flags=FLAGS, after_step=step, inside=not at.startswith("/")),
           Op(0, "write", at, data=data, fd=fd, after_step=step, inside=not at.startswith("/"))]
    return ops + ([Op(0, "rename", stage, target=path, after_step=step)] if stage else [])


def test_a_save_puts_what_it_writes_makes_and_renames_in_never_what_it_only_reads():
    run = run_of(Op(0, "mkdir", "step-3", after_step=3), *put(3, "step-3/model.pt", b"three"),
                 Op(0, "mkdir", ".stage", after_step=6), *put(6, ".stage/model.pt", b"six"),
                 Op(0, "rename", ".stage", target="step-6", after_step=6),
                 Op(0, "link", "step-3/model.pt", target="step-6/base.pt", after_step=6),
                 Op(0, "copy", "step-6/copy.pt", target="step-3/model.pt", data=None, offset=0, length=5, after_step=6),
                 Op(0, "symlink", "latest", target="step-3", after_step=6),
                 Op(0, "unlink", "step-3/gone.pt", after_step=6), Op(0, "fsync", ".", after_step=6))
    assert save_paths(run)[6] == (".stage", "step-6", ".stage/model.pt", "step-6/model.pt", "step-6/base.pt",
                                  "step-6/copy.pt", "latest")


def test_a_link_or_a_copy_from_an_older_checkpoint_does_not_make_its_file_the_new_saves():
    """The rule crash_states.save_files had (every path a save's operation named, sources too) gave
    step-3/model.pt to the save of step 6, which only linked it: corruption_detected then held no
    checkpoint to fall back to."""
    run = run_of(Op(0, "mkdir", "step-3", after_step=3), *put(3, "step-3/model.pt", b"three"),
                 Op(0, "mkdir", "step-6", after_step=6), *put(6, "step-6/delta.pt", b"six"),
                 Op(0, "link", "step-3/model.pt", target="step-6/base.pt", after_step=6),
                 Op(0, "create", "step-6/copy.pt", fd=5, flags=FLAGS, after_step=6),
                 Op(0, "copy", "step-6/copy.pt", target="step-3/model.pt", data=None, fd=5, offset=0, length=5,
                    after_step=6))
    assert set(save_files(run)[6]) == {"step-6/delta.pt", "step-6/base.pt", "step-6/copy.pt"}
    held = saves_held(run)
    assert held == {3: {"step-3/model.pt"}, 6: {"step-6/delta.pt", "step-6/base.pt", "step-6/copy.pt"}}
    assert fallback_step(held, 6) == 3


def test_the_newest_checkpoint_staged_in_a_directory_outside_and_renamed_in_is_found(tmp_path):
    """The rule checks/common.py had (the names the save's operations under the directory wrote)
    found no file at all: the writes were outside it, the rename brought in a directory."""
    run = run_of(*put(3, "/stage/a/model.pt", None), Op(0, "rename", "/stage/a", target="step-3", after_step=3),
                 *put(6, "/stage/b/model.pt", None), Op(0, "rename", "/stage/b", target="step-6", after_step=6),
                 ckpt_dir=tmp_path)
    for step in (3, 6):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "model.pt").write_bytes(b"x")
    assert [p.relative_to(tmp_path).as_posix() for p in newest_checkpoint_files(run, 6)] == ["step-6/model.pt"]
    assert set(save_files(with_stand_in_bytes(run))) == {3, 6}


def test_the_newest_files_keep_the_order_their_save_first_wrote_them(tmp_path):
    run = run_of(*put(3, "b.pt", b"b", stage="b.tmp"), *put(3, "a.pt", b"a", stage="a.tmp", fd=5), ckpt_dir=tmp_path)
    for name in ("a.pt", "b.pt"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in newest_checkpoint_files(run, 3)] == ["b.pt", "a.pt"]


def test_a_directory_every_save_renames_onto_one_name_tells_no_checkpoint_apart():
    """The rule retention had (the exact names each save's operations wrote) missed the files a
    rename of a directory brought in: `latest/meta.json`, rewritten by every save, told checkpoint 3
    apart, so it looked gone once save 6 replaced it, though step-3/ was all there."""
    def save(step: int) -> list[Op]:
        return [*put(step, f"step-{step}/model.pt", b"m%d" % step), *put(step, ".next/meta.json", b"%d" % step, fd=5),
                Op(0, "unlink", "latest/meta.json", after_step=step), Op(0, "rmdir", "latest", after_step=step),
                Op(0, "rename", ".next", target="latest", after_step=step)]
    run = run_of(Op(0, "mkdir", "step-3", after_step=3), *save(3), Op(0, "mkdir", "step-6", after_step=6), *save(6))
    assert set(retained.own_files(run)[3]) == {"step-3/model.pt"}
    assert retained.kept_after_commits(run)[6] == (3,)


# -- reshard's kill: on the loss log, like every step point, and proven to land ---------------------

def log_line(path: str, step: int, killed: bool = False) -> str:
    end = "<unfinished ...>\n100  +++ killed by SIGKILL +++" if killed else "= 27"
    return f'100  write(7<{path}>, "{{\\"step\\": {step}, \\"loss\\": 0.5}}\\n", 27) {end}'


def saved(ckpt: str, step: int) -> list[str]:
    tmp = f"{ckpt}/.ckpt-{step}.tmp"
    return [f'100  openat(AT_FDCWD</run>, "{tmp}", {FLAGS}, 0644) = 3<{tmp}>', f'100  write(3<{tmp}>, "s{step}", 2) = 2',
            f'100  rename("{tmp}", "{ckpt}/ckpt-{step}") = 0']


def trace(log: str, ckpt: str, steps: int, spec: RunSpec, *, killed_at: int | None = None) -> str:
    lines = []
    for k in range(1, steps + 1):
        lines.append(log_line(log, k, killed=k == killed_at))
        if k == killed_at:
            break
        if k % spec.save_every == 0:
            lines += saved(ckpt, k)
    return "\n".join(lines) + "\n"


class FakeRunner:
    """Rank 0's first job and the resumed job, as strace and the trainer would leave them: the
    first killed where its -P argv says, unless `missed`."""

    def __init__(self, spec: RunSpec, missed: bool):
        self.spec, self.missed, self.argvs = spec, missed, []

    def run_process(self, adapter, spec, ckpt, log, *, tracing=None, stop=None):
        steps = range(1, self.spec.total_steps + 1)
        if tracing is None:   # the resumed job: from the checkpoint of step 4, on the curve
            return ProcessResult(0, {k: 0.5 for k in steps if k > 4}, "")
        argv, _ = tracing.ranks[0]
        self.argvs.append(argv)
        path, when = argv[argv.index("-P") + 1], int(argv[-2].rsplit("when=", 1)[1])
        last = self.spec.total_steps if self.missed else when - 1
        losses = {k: 0.5 for k in steps if k <= last}
        text = trace(path, str(ckpt.resolve()), self.spec.total_steps, self.spec, killed_at=None if self.missed else when)
        return ProcessResult(0 if self.missed else -9, losses, "", rank_losses=(losses, losses), traces={0: text})


class FakeSession:
    def __init__(self, tmp_path: Path, spec: RunSpec, missed: bool):
        self.tmp_path, self.runner, self.cap, self.adapter = tmp_path, FakeRunner(spec, missed), 1e-6, None
        text = trace("/base/loss.jsonl", "/base/ck", spec.total_steps, spec)
        result = ProcessResult(0, {k: 0.5 for k in range(1, spec.total_steps + 1)}, "")
        self.base = recording.build(strace.parse(text), spec, result, Path("/base/ck"), Path("/base/loss.jsonl"))

    def baseline(self, spec):
        return self.base

    def case_dir(self, name):
        d = self.tmp_path / name
        d.mkdir()
        return d

    def fail(self, check, spec, problem, **kw):
        return AssertionError(problem)


@pytest.mark.parametrize("missed", [False, True], ids=["landed", "missed"])
def test_reshard_kills_rank_0_on_its_loss_log_and_proves_the_kill_landed(tmp_path, missed):
    """The kill used to be built by hand (`write` #done+1 on the loss log) and never checked: a kill
    that missed left a later checkpoint, and the resume from it was judged as a reshard."""
    spec = RunSpec(8, 2, 0, world_size=2)
    session = FakeSession(tmp_path.resolve(), spec, missed)
    evidence.take()
    if missed:
        with pytest.raises(CrashNotLanded, match="step:5@r0"):
            ranks.reshard(session, "reshard", spec, "shrink", None)
        assert not any("resumed from" in e.summary() for e in evidence.take())   # no resumed job ran
    else:
        ranks.reshard(session, "reshard", spec, "shrink", None)
        assert any("resumed from step 4" in e.summary() for e in evidence.take())
    argv = session.runner.argvs[0]
    # The save of step 4 is committed as step 5 is logged: rank 0 dies on the write that logs step 6,
    # counted from the baseline's own loss-log writes.
    assert argv[argv.index("-P") + 1] == str(rank_log(tmp_path.resolve() / "reshard" / "first-loss.jsonl", 0, 2))
    assert "inject=write:signal=KILL:when=6" in argv
