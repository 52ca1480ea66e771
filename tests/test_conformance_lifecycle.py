"""The checks of a job's life around its faults, judged as pure functions on synthetic outcomes
(`checks.interrupt.judge`, `checks.compound.judge`), and what retention promised, learned from a
synthetic recording (`offline.retained`): no process started."""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks import compound, interrupt, lifecycle
from conformance.faults.injection import FaultOutcome
from conformance.model.process import ProcessResult
from conformance.offline import retained
from conformance.trace.recording import Op, RecordedRun
from conformance.trace.strace import Syscall
from tests.strategies import judged_fixture, never_plain, resumed_curve

SPEC, BASELINE, POINT, KILL = judged_fixture()


def curve(after: int, *, bent_at: int | None = None) -> dict[int, float]:
    return resumed_curve(BASELINE, after, bent_at=bent_at)


# -- interrupt --------------------------------------------------------------------------------------
def interrupted(code: int = 130, *, stopped: str = "", upto: int = 9) -> ProcessResult:
    return ProcessResult(code, {k: v for k, v in BASELINE.items() if k <= upto}, "KeyboardInterrupt", stopped=stopped)


def judged_interrupt(first: ProcessResult, final: ProcessResult) -> str | None:
    found = interrupt.judge(FaultOutcome(SPEC, POINT, "signal=INT", KILL, first, None, final), BASELINE, 1e-4,
                            grace_s=5, same_as_plain=never_plain)
    return found and found[0]


def test_an_interrupted_trainer_that_exits_and_resumes_from_the_committed_checkpoint_passes():
    assert judged_interrupt(interrupted(), ProcessResult(0, curve(6), "")) is None


@pytest.mark.parametrize("first, final, expected", [
    (interrupted(stopped="SIGKILLed 5 s after SIGINT"), ProcessResult(0, curve(6), ""), "still running 5 s after"),
    (interrupted(0), ProcessResult(0, curve(6), ""), "exited 0 at step 9 of 14"),
    (interrupted(), ProcessResult(3, {}, "IncompleteCheckpointError"), "could not resume (exit 3): it took the"),
    (interrupted(), ProcessResult(0, curve(3), ""), "resumed from step 3, older than the checkpoint of step 6"),
    (interrupted(), ProcessResult(0, curve(9, bent_at=11), ""), "committed a torn or mixed state"),
])
def test_each_way_an_interrupt_goes_wrong_is_named(first, final, expected):
    assert expected in (judged_interrupt(first, final) or "")


def test_a_trainer_interrupted_in_its_last_step_that_finishes_the_run_passes():
    assert judged_interrupt(interrupted(0, upto=14), ProcessResult(0, {}, "")) is None


# -- compound_faults ----------------------------------------------------------------------------------
def state(promised: int, *, in_progress: int | None = 9, whole: bool = False, intact: bool = True
          ) -> retained.CompoundState:
    return retained.CompoundState("kill", 40, 6, promised, in_progress, whole, ("step-6/model.pt",), intact)


def judged_compound(s: retained.CompoundState, code: int, losses: dict[int, float], r: int) -> str | None:
    return compound.judge(s, code, losses, r, BASELINE, 1e-4, 10, never_plain)


def test_falling_back_to_the_promised_checkpoint_passes():
    assert judged_compound(state(3), 0, curve(3), 3) is None


def test_a_newer_intact_checkpoint_than_the_promised_one_passes():
    assert judged_compound(state(3, whole=True), 0, curve(9), 9) is None


def test_with_nothing_promised_starting_over_or_failing_loudly_passes():
    assert judged_compound(state(0), 0, curve(0), 0) is None
    assert judged_compound(state(0), 3, {}, -1) is None


def test_stopping_loudly_while_the_promised_checkpoint_is_there_passes():
    assert judged_compound(state(3), 3, {}, -1) is None


def test_the_promised_checkpoint_may_go_once_the_interrupted_save_is_whole():
    assert judged_compound(state(3, whole=True, intact=False), 0, curve(9), 9) is None
    assert judged_compound(state(3, whole=True, intact=False), 3, {}, -1) is None


@pytest.mark.parametrize("s, code, losses, r, expected", [
    (state(3, intact=False), 0, curve(0), 0, "resumed from scratch: retention had deleted the checkpoint of step 3"),
    (state(3, intact=False), 3, {}, -1, "exited 3: retention had deleted the checkpoint of step 3"),
    (state(3), 0, curve(0), 0, "resumed from scratch, though the checkpoint of step 3"),
    (state(3), 0, curve(6, bent_at=8), 6, "diverges: it loaded the damaged"),
    (state(0), 0, curve(0, bent_at=2), 0, "diverges"),
    (state(3), 0, {}, 10, "exited 0 without training"),
])
def test_each_way_a_second_fault_goes_wrong_is_named(s, code, losses, r, expected):
    assert expected in (judged_compound(s, code, losses, r) or "")


# -- what retention promised, learned from a recording -------------------------------------------------
def _run(ops: list[tuple]) -> RecordedRun:
    """A recording from (kind, path, target, data, save) rows, in order."""
    built = [Op(i, kind, path, target=target or "", data=data if data is not None else b"", save=save,
                after_step=save, flags="O_CREAT|O_TRUNC" if kind == "create" else "")
             for i, (kind, path, target, data, save) in enumerate(ops)]
    return RecordedRun(SPEC, ProcessResult(0, dict(BASELINE), ""), Path("/nonexistent"), tuple(built), {},
                       frozenset())


def _save(step: int, *, prune: int | None = None, prune_first: bool = False) -> list[tuple]:
    name = f"ckpt-{step}.pt"
    write = [("create", f".tmp-{step}", None, None, step), ("write", f".tmp-{step}", None, b"x" * step, step),
             ("rename", f".tmp-{step}", name, None, step), ("create", "latest", None, None, step),
             ("write", "latest", None, str(step).encode(), step)]
    drop = [("unlink", f"ckpt-{prune}.pt", None, None, step)] if prune else []
    return drop + write if prune_first else write + drop


def test_retention_that_deletes_after_the_commit_promised_the_older_checkpoint():
    run = _run(_save(3) + _save(6) + _save(9, prune=3))
    assert retained.kept_after_commits(run) == {3: (), 6: (3,), 9: (6,)}
    assert set(retained.own_files(run)[6]) == {"ckpt-6.pt"}   # `latest` is every save's: it tells nothing


def _threaded(ops: list[tuple], tid_of) -> RecordedRun:
    """`_run`, each removal marked as retention after the save it follows, made by thread
    `tid_of(op)`; the training thread (1) logs the steps."""
    run = _run(ops)
    ops = tuple(Op(o.index, o.kind, o.path, target=o.target, data=o.data, save=0 if o.kind == "unlink" else o.save,
                   retention=o.save if o.kind == "unlink" else 0, after_step=o.after_step, flags=o.flags, tid=tid_of(o))
                for o in run.ops)
    return RecordedRun(SPEC, run.result, run.ckpt_dir, ops, {9: Syscall(0, 1, "write", 1, (), "1")}, frozenset())


def test_a_removal_on_a_background_thread_is_never_promised_against():
    # keep 2 on a purge thread (torchtitan): which commit set it going cannot be seen, so the
    # checkpoint it removes is not one the save after it must leave in place.
    ops = _save(3) + _save(6) + _save(9, prune=3) + _save(12, prune=6)
    background = _threaded(ops, lambda o: 2 if o.kind == "unlink" else 1)
    assert retained.removed_in_background(background, retained.own_files(background)) == {3, 6}
    assert retained.promised_beside(background, 9, retained.own_files(background)) == ()
    # The same retention on the training thread, before the save it makes room for, is caught.
    early = _threaded(_save(3) + _save(6) + _save(9, prune=3, prune_first=True), lambda o: 1)
    assert retained.promised_beside(early, 6, retained.own_files(early)) == (3,)
    assert retained.steady_count(early, retained.own_files(early)) == 2


def test_a_kill_after_an_early_prune_leaves_the_promised_checkpoint_missing():
    run = _run(_save(3) + _save(6) + _save(9, prune=3, prune_first=True))
    inside_nine = next(op.index for op in run.ops if op.save == 9 and op.kind == "create")
    found = retained.compound_state(run, "kill", inside_nine)
    assert found is not None
    s, files, _, _ = found
    assert (s.damaged, s.promised, s.in_progress, s.promised_intact) == (6, 3, 9, False)
    assert "ckpt-3.pt" not in files and len(files["ckpt-6.pt"]) == 3   # gone; the damaged one cut in half


def test_a_fault_in_the_retention_after_a_commit_damages_that_new_checkpoint():
    # The save of step 9 has written and renamed its file; its retention (unlinking step 3) is what
    # the fault interrupts: step 9 is the newest committed checkpoint, and retention keeps 6 beside it.
    run = _run(_save(3) + _save(6) + _save(9, prune=3))
    prune = next(op.index for op in run.ops if op.save == 9 and op.kind == "unlink")
    s, files, _, _ = retained.compound_state(run, "kill", prune)
    assert (s.damaged, s.promised, s.in_progress, s.promised_intact) == (9, 6, None, True)
    assert len(files["ckpt-9.pt"]) == 4 and files["ckpt-6.pt"] == b"x" * 6


def test_the_steps_a_restart_trained_are_named_as_ranges():
    assert lifecycle._steps({1: 0, 2: 0, 3: 0, 7: 0}) == "steps 1-3, 7"
    assert lifecycle._steps({5: 0}) == "step 5"
