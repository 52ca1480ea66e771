"""corruption_detected: the fallback a damaged newest checkpoint allows is learned from what the
checkpoint directory really holds (checks/damage.py, saves_held), not from the save cadence."""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from conformance.checks.damage import fallback_step, saves_held
from conformance.checks.session import Session
from conformance.model.adapters import load_object
from conformance.model.process import ProcessResult, RunSpec
from conformance.trace import recording, strace
from conformance.trace.recording import Op, RecordedRun

ROOT = Path("/run/ck")
WRITE_FLAGS = "O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC"


def run_of(*ops: Op) -> RecordedRun:
    """A single-threaded run of `ops`: each belongs to the save of the step logged before it."""
    attributed = {"save"} & {f.name for f in dataclasses.fields(Op)}   # recording.attribute_saves
    ops = tuple(dataclasses.replace(op, index=i, **{f: op.after_step for f in attributed}) for i, op in enumerate(ops))
    return RecordedRun(RunSpec(9, 3, 0), ProcessResult(0, {}, ""), ROOT, ops, {}, frozenset())


def write_file(step: int, path: str, data: bytes | None, fd: int = 4) -> list[Op]:
    """A file written through a temp name and renamed into place, in the save of `step`."""
    tmp = f"{path}.tmp"
    return [Op(0, "create", tmp, fd=fd, flags=WRITE_FLAGS, after_step=step),
            Op(0, "write", tmp, data=data, fd=fd, after_step=step),
            Op(0, "fsync", tmp, fd=fd, after_step=step),
            Op(0, "rename", tmp, target=path, after_step=step)]


def step_dir_save(step: int, data: bytes | None = None) -> list[Op]:
    """A save of `step` as a directory of two files (bytes cut short by the trace unless given)."""
    d = f"step-{step}"
    return [Op(0, "mkdir", d, after_step=step), *write_file(step, f"{d}/model.pt", data),
            *write_file(step, f"{d}/index.json", b'{"step": %d}' % step, fd=5)]


def retire(step: int, older: int) -> list[Op]:
    """Retention, in the save of `step`, deleting the checkpoint of step `older`."""
    d = f"step-{older}"
    return [Op(0, "unlink", f"{d}/model.pt", after_step=step), Op(0, "unlink", f"{d}/index.json", after_step=step),
            Op(0, "rmdir", d, after_step=step)]


def test_a_trainer_keeping_two_checkpoints_may_fall_back_to_the_older_one():
    run = run_of(*step_dir_save(3), *step_dir_save(6), *step_dir_save(9), *retire(9, 3))
    held = saves_held(run)
    assert held == {6: {"step-6/model.pt", "step-6/index.json"}, 9: {"step-9/model.pt", "step-9/index.json"}}
    assert fallback_step(held, 9) == 6


def test_a_trainer_keeping_one_checkpoint_has_nothing_to_fall_back_to():
    """The issue: with one checkpoint kept, `stop - save_every` named a step the directory did not
    hold. Nothing older is there, so starting from scratch is right."""
    run = run_of(*step_dir_save(3), *step_dir_save(6), *retire(6, 3), *step_dir_save(9), *retire(9, 6))
    held = saves_held(run)
    assert set(held) == {9}
    assert fallback_step(held, 9) == 0


def test_a_save_missing_one_of_its_files_is_not_held():
    run = run_of(*step_dir_save(3), *step_dir_save(6), Op(0, "unlink", "step-3/model.pt", after_step=6))
    assert set(saves_held(run)) == {6}


def test_a_file_a_later_save_rewrote_under_the_same_name_is_the_later_saves():
    """Lightning's `last.ckpt`: each save replaces it; the older save is still held by its own
    per-step file (a trainer that restarts from scratch when `last.ckpt` is damaged loses it)."""
    run = run_of(*write_file(3, "epoch=0-step=3.ckpt", None), *write_file(3, "last.ckpt", None, fd=5),
                 *write_file(6, "epoch=1-step=6.ckpt", None), *write_file(6, "last.ckpt", None, fd=5))
    held = saves_held(run)
    assert held == {3: {"epoch=0-step=3.ckpt"}, 6: {"epoch=1-step=6.ckpt", "last.ckpt"}}
    assert fallback_step(held, 6) == 3


def test_a_file_rewritten_in_place_with_the_same_bytes_keeps_its_save():
    run = run_of(*write_file(3, "ckpt-3.pt", b"three"), *write_file(3, "latest", b"ckpt-3.pt", fd=5),
                 *write_file(6, "ckpt-6.pt", b"six"), *write_file(6, "latest", b"ckpt-6.pt", fd=5),
                 *write_file(9, "ckpt-9.pt", b"nine"), *write_file(9, "latest", b"ckpt-6.pt", fd=5))
    # `latest` is the newest save's (it rewrote it); 3 and 6 are held by their own files.
    assert set(saves_held(run)) == {3, 6, 9}


def test_bytes_the_trace_cut_short_and_copies_need_no_data():
    """The prefix run is traced for paths only: its large writes carry no bytes, and a copy's bytes
    come from elsewhere. Each is replayed with stand-in bytes of its own, so a later operation on a
    file still shows as a change."""
    run = run_of(*step_dir_save(3), *step_dir_save(6),
                 Op(0, "create", "step-3/model.pt", fd=7, flags=WRITE_FLAGS, after_step=6),
                 Op(0, "copy", "step-3/model.pt", target="/elsewhere/model.pt", data=None, fd=7, length=10,
                    after_step=6),
                 *step_dir_save(9))
    assert set(saves_held(run)) == {6, 9}
    assert fallback_step(saves_held(run), 9) == 6


def test_a_save_that_left_no_file_is_no_checkpoint():
    run = run_of(*step_dir_save(3), Op(0, "mkdir", "step-6", after_step=6), *step_dir_save(9))
    assert set(saves_held(run)) == {3, 9}
    assert fallback_step(saves_held(run), 9) == 3


def test_from_a_trace_recorded_for_paths_only():
    """A parsed trace without data (the prefix run's): writes longer than strace's -s end in `...`."""
    big = '"' + "\\x00" * 16 + '"...'

    def save(step: int) -> list[str]:
        d = f"/run/ck/step-{step}"
        return [f'1 mkdir("{d}", 0777) = 0',
                f'1 openat(AT_FDCWD</run>, "{d}/.m.tmp", {WRITE_FLAGS}, 0644) = 4<{d}/.m.tmp>',
                f"1 write(4<{d}/.m.tmp>, {big}, 100000) = 100000",
                f'1 rename("{d}/.m.tmp", "{d}/model.pt") = 0']

    def log(step: int) -> str:
        return f'1 write(5</run/loss.jsonl>, "{{\\"step\\": {step}}}\\n", 13) = 13'

    def retire_lines(step: int) -> list[str]:
        return [f'1 unlinkat(AT_FDCWD</run>, "/run/ck/step-{step}/model.pt", 0) = 0',
                f'1 unlinkat(AT_FDCWD</run>, "/run/ck/step-{step}", AT_REMOVEDIR) = 0']

    text = "\n".join([log(1), log(2), log(3), *save(3), log(4), log(5), log(6), *save(6), *retire_lines(3)])
    run = recording.build(strace.parse(text), RunSpec(6, 3, 0), ProcessResult(0, {}, ""), ROOT,
                          Path("/run/loss.jsonl"))
    assert run.saves() == [3, 6]
    assert any(op.kind == "write" and op.data is None for op in run.ops)
    assert saves_held(run) == {6: {"step-6/model.pt"}}
    keep_two = recording.build(strace.parse("\n".join(text.splitlines()[:-2])), RunSpec(6, 3, 0),
                               ProcessResult(0, {}, ""), ROOT, Path("/run/loss.jsonl"))
    assert fallback_step(saves_held(keep_two), 6) == 3


# -- with real trainers ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.needs_strace
@pytest.mark.parametrize("adapter, fallback", [("resume_conformance.fixtures.reference_trainer:ADAPTER", 9),
                                               ("resume_conformance.fixtures.keep_one_trainer:ADAPTER", 0)])
def test_the_prefix_run_tells_what_a_damaged_checkpoint_may_fall_back_to(tmp_path, adapter, fallback):
    session = Session(load_object(adapter), workdir=Path(tempfile.mkdtemp(dir=tmp_path)))
    try:
        prefix, stop = session.prefix(RunSpec(14, 3, 0))
        held = saves_held(prefix)
        assert stop == 12 and stop in held
        assert fallback_step(held, stop) == fallback
    finally:
        session.close()


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_correct_trainer_keeping_one_checkpoint_passes_corruption_detected(run_suite):
    """Issue 22: it starts from scratch when its only checkpoint is damaged, which is right."""
    verdicts, out = run_suite("--adapter=resume_conformance.fixtures.keep_one_trainer:ADAPTER",
                              "--hypothesis-profile=conformance-quick",
                              "-k", "test_corruption_detected or test_determinism_precondition")
    ran = {name: v for name, v in verdicts.items() if name.startswith("test_corruption_detected[")}
    assert set(ran) == {"test_corruption_detected[truncate]", "test_corruption_detected[bitflip]",
                        "test_corruption_detected[delete]"}, out[-3000:]
    bad = {name: message[:2000] for name, (outcome, message) in verdicts.items() if outcome != "passed"}
    assert not bad, bad
