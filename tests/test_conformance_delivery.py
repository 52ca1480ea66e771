"""Meta-tests of how a fault lands and is proven to (conformance/faults/delivery.py): the choice of route
(on the loss log, by path, by count), each route's proof of landing, and retries; and of the count
shifts a job's retries learn (conformance/faults/shifts.py); with recorded runs (strace text parsed by
the one parser) and hand-made ones as data."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.faults.delivery import (
    AtOperation,
    CrashNotLanded,
    KillMissedCount,
    OnLog,
    PlannedKill,
    check_fault_landed,
    choose_route,
)
from conformance.model.crash import CrashPoint
from conformance.model.process import ProcessResult, RunSpec
from conformance.trace import recording, strace

ROOT, LOG = Path("/ck"), Path("/other/loss.jsonl")


def log(step: int, tid: int = 100, killed: bool = False) -> str:
    end = "<unfinished ...>\n100  +++ killed by SIGKILL +++" if killed else "= 27"
    return f'{tid}  write(7</other/loss.jsonl>, "{{\\"step\\": {step}, \\"loss\\": 0.5}}\\n", 27) {end}'


def save(step: int, tid: int = 100, *, fail: str = "") -> list[str]:
    tmp, err = f"/ck/.ckpt-{step}.tmp", (f" = -1 {fail} (Input/output error) (INJECTED)" if fail else " = 0")
    return [f'{tid}  openat(AT_FDCWD</run>, "{tmp}", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = 3<{tmp}>',
            f'{tid}  write(3<{tmp}>, "s{step}", 2) = 2',
            f'{tid}  fsync(3<{tmp}>){err}',
            f'{tid}  rename("{tmp}", "/ck/ckpt-{step}") = 0']


def recorded(lines: list[str], steps: int = 4) -> recording.RecordedRun:
    result = ProcessResult(0, {s: 0.5 for s in range(1, steps + 1)}, "")
    return recording.build(strace.parse("\n".join(lines) + "\n"), RunSpec(steps, 2, 0), result, ROOT, LOG)


UNINTERRUPTED = [log(1), log(2)] + save(2) + [log(3), log(4)] + save(4)


def fsync_of_save_4(planned: recording.RecordedRun) -> CrashPoint:
    """The `fs:i` point of the save of step 4's fsync (i counts the mutations)."""
    return CrashPoint("fs", next(k for k, i in enumerate(planned.mutations)
                                 if planned.ops[i].kind == "fsync" and planned.ops[i].save == 4))


def test_a_step_point_lands_on_the_loss_log_whatever_else_the_process_writes():
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(CrashPoint("step", 2), planned)
    route = choose_route(kill, planned, frozenset(), ROOT, LOG, job=False)
    assert isinstance(route, OnLog) and route.nth == 3 and route.path == str(LOG)   # the write that logs step 3
    argv = route.argv(Path("/t"), kill)
    assert argv[argv.index("-P") + 1] == str(LOG) and "inject=write:signal=KILL:when=3" in argv
    killed = recorded([log(1), log(2)] + save(2) + [log(3, killed=True)], steps=2)
    route.check(kill, planned, killed, killed.result)
    early = recorded([log(1), log(2, killed=True)], steps=1)
    with pytest.raises(CrashNotLanded, match="after step 1 was logged"):
        route.check(kill, planned, early, early.result)


def test_a_step_point_whose_run_must_be_recorded_whole_goes_by_count():
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(CrashPoint("step", 2), planned)
    route = choose_route(kill, planned, frozenset(), ROOT, LOG, job=False, whole_recording=True)
    assert isinstance(route, AtOperation) and route.counting()


def test_an_fs_point_of_a_single_thread_goes_by_count_and_of_a_threaded_one_by_path_when_its_path_is_stable():
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(fsync_of_save_4(planned), planned)
    assert "fsync" in kill.text and kill.in_progress == 4
    assert choose_route(kill, planned, frozenset(), ROOT, LOG, job=False).counting()
    by_path = choose_route(kill, planned, frozenset({".ckpt-4.tmp"}), ROOT, LOG, job=True)
    assert not by_path.counting() and by_path.target == (".ckpt-4.tmp", 1)
    assert "-P" in by_path.argv(Path("/t"), kill, "error=EIO")


def test_a_path_delivery_that_missed_counts_from_then_on():
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(fsync_of_save_4(planned), planned)
    route = choose_route(kill, planned, frozenset({".ckpt-4.tmp"}), ROOT, LOG, job=True)
    missed = recorded([log(1), log(2)] + save(2) + [log(3), log(4)] + save(4), steps=4)
    with pytest.raises(CrashNotLanded, match="the rank was not reached"):
        route.check(kill, planned, missed, missed.result, "error=EIO")
    assert route.counting()


def test_an_error_by_count_is_proven_at_the_planned_operation():
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(fsync_of_save_4(planned), planned)
    failed = recorded([log(1), log(2)] + save(2) + [log(3), log(4)] + save(4, fail="EIO"))
    check_fault_landed(kill, planned, failed, error=True)
    wrong = recorded([log(1), log(2)] + save(2, fail="EIO") + [log(3), log(4)] + save(4))
    with pytest.raises(KillMissedCount, match="hit fsync #3 of the save of step 2: fsync .ckpt-2.tmp instead"):
        check_fault_landed(kill, planned, wrong, error=True)
    short = recorded([log(1), log(2)] + save(2)[:2], steps=2)
    with pytest.raises(KillMissedCount, match="made only"):
        check_fault_landed(kill, planned, short, error=True)


def test_an_error_that_hit_another_call_is_a_miss_whatever_the_trainer_did_after_it():
    """A job's write counts drift: an error meant for a save's write may hit the loss log, or an
    earlier write, after which a correct trainer abandons that save. The same operations up to
    the hit make it a miss (retried, then another point), not a difference in the trainer."""
    planned = recorded(UNINTERRUPTED)
    from conformance.faults.scenario import plan
    kill = plan(fsync_of_save_4(planned), planned)
    on_log = recorded([log(1), log(2)] + save(2) + [log(3),
                      '100  write(7</other/loss.jsonl>, "{\\"step\\": 4, \\"loss\\": 0.5}\\n", 27) = -1 ENOSPC '
                      '(No space left on device) (INJECTED)'], steps=3)
    with pytest.raises(KillMissedCount, match="hit its loss log instead"):
        check_fault_landed(kill, planned, on_log, error=True)
    abandoned = recorded([log(1), log(2)] + save(2, fail="EIO")[:3] + ['100  unlink("/ck/.ckpt-2.tmp") = 0',
                         log(3), log(4)] + save(4))
    with pytest.raises(KillMissedCount, match="save of step 2"):
        check_fault_landed(kill, planned, abandoned, error=True)
    # Operations that differ before the fault hit are the trainer's, not the delivery's.
    differs = recorded([log(1), log(2), '100  mkdir("/ck/extra", 0777) = 0'] + save(2, fail="EIO") + [log(3), log(4)]
                       + save(4))
    with pytest.raises(CrashNotLanded) as caught:
        check_fault_landed(kill, planned, differs, error=True)
    assert not isinstance(caught.value, KillMissedCount)


def test_a_shifted_count_is_guessed_from_the_most_common_shift_of_its_own_syscall():
    from conformance.faults.shifts import ShiftGuesses

    class Run:   # stands in for a planned run: only its identity matters
        pass

    guesses, run, other = ShiftGuesses(), Run(), Run()
    assert [guesses.guess(run, "write", a) for a in (1, 2, 3, 4)] == [0, 1, 2, -1]   # nothing seen: 0, then small
    guesses.record(run, "write", 1)
    guesses.record(run, "write", None)          # a landing that could not tell
    assert guesses.guess(run, "write", 1) == 1 and guesses.guess(other, "write", 1) == 0
    assert guesses.guess(run, "mkdir", 1) == 0  # gloo's extra writes do not move another syscall's count
    guesses.record(run, "write", 0)
    guesses.record(run, "write", 0)
    assert guesses.guess(run, "write", 5) == 0
    # A shift never plans a count below the first call (strace rejects when=0: the rank would wait
    # for its tracer for ever).
    guesses.record(run, "mkdir", -1)
    first_mkdir = PlannedKill(CrashPoint("fs", 0, 1), "mkdir", 1, "rank 1: mkdir", 0, 0, 3)
    assert guesses.shifted(first_mkdir, run, 1).nth == 1
    assert guesses.shifted(dataclasses.replace(first_mkdir, nth=3), run, 1).nth == 2


def _run(ops):
    """A rank's recorded run made of `(kind, path, target, syscall, tid, killed)` operations."""
    from conformance.trace.recording import Op, RecordedRun
    built = tuple(Op(i, kind, path, target=target, syscall=syscall, tid=tid, killed=killed, after_step=3)
                  for i, (kind, path, target, syscall, tid, killed) in enumerate(ops))
    return RecordedRun(RunSpec(14, 3, 0, 2), None, Path("/ck"), built, {}, frozenset())


def test_a_kill_on_a_path_every_run_shares_counts_only_its_threads_calls_on_that_path():
    from conformance.faults.delivery import path_delivery
    view = _run([("write", "s/rank1.pt", "", "write", 10, False),      # the main thread
                 ("write", "s/__1_0.distcp", "", "write", 11, False),  # a background writer
                 ("write", "s/rank1.pt", "", "write", 10, False),
                 ("write", "s/__1_0.distcp", "", "write", 11, False),
                 ("fsync", "s/__1_0.distcp", "", "fsync", 11, False),
                 ("unlink", "s/old", "", "unlinkat", 10, False),
                 ("write", "s/.tmp-83jd", "", "write", 10, False)])
    stable = frozenset({"s/rank1.pt", "s/__1_0.distcp", "s/old"})

    def at(k):
        return PlannedKill(CrashPoint("fs", k, 1), view.ops[k].syscall, 99, "", k, 0, 3)

    assert path_delivery(at(3), view, stable) == ("s/__1_0.distcp", 2)   # the writer's 2nd write to it
    assert path_delivery(at(4), view, stable) == ("s/__1_0.distcp", 1)   # its 1st fsync of it
    assert path_delivery(at(2), view, stable) == ("s/rank1.pt", 2)
    assert path_delivery(at(5), view, stable) is None    # unlinkat: -P does not resolve a dirfd-relative name
    assert path_delivery(at(6), view, stable) is None    # a run-random name: counted instead


def test_a_kill_by_path_landed_only_on_the_planned_call():
    from conformance.faults.delivery import CrashNotLanded, check_landed_on_path
    kill = PlannedKill(CrashPoint("fs", 3, 1), "write", 99, "rank 1: write", 3, 0, 3)
    first_write = _run([("write", "s/__1_0.distcp", "", "write", 11, True)])
    second_write = _run([("write", "s/__1_0.distcp", "", "write", 11, False),
                         ("write", "s/__1_0.distcp", "", "write", 11, True)])
    check_landed_on_path(kill, "s/__1_0.distcp", 2, second_write)
    with pytest.raises(CrashNotLanded, match=r"it hit write .* \(call #1 on it\)"):
        check_landed_on_path(kill, "s/__1_0.distcp", 2, first_write)
    with pytest.raises(CrashNotLanded, match="the rank was not reached"):
        check_landed_on_path(kill, "s/__1_0.distcp", 2, _run([("write", "s/__1_0.distcp", "", "write", 11, False)]))


def test_an_error_delivered_by_path_landed_on_the_planned_call():
    import dataclasses as dc

    from conformance.faults.delivery import CrashNotLanded, check_landed_on_path
    kill = PlannedKill(CrashPoint("fs", 4, 1), "fsync", 99, "rank 1: fsync", 4, 0, 3)
    run = _run([("fsync", "s/__1_0.distcp", "", "fsync", 11, False)])
    failed = dc.replace(run, ops=(dc.replace(run.ops[0], error="EIO"),))
    check_landed_on_path(kill, "s/__1_0.distcp", 1, failed)
    with pytest.raises(CrashNotLanded):
        check_landed_on_path(kill, "s/rank1.pt", 1, failed)   # the error hit another file


def test_a_count_shift_is_measured_at_the_last_loss_log_write_before_the_point():
    """gloo's wake-up writes can grow during a run (a group first used by an async save): the
    shift at step 1's log says nothing about a point in the save of step 3."""
    import dataclasses as dc

    from conformance.faults.shifts import count_shift
    from conformance.trace.strace import Syscall

    def logs(counts):
        return {step: Syscall(step, 10, "write", n, (), "39") for step, n in counts.items()}

    planned = dc.replace(_run([("write", "s/.tmp-a", "", "write", 10, False)]), step_logs=logs({1: 1, 3: 10}))
    landed = dc.replace(_run([]), step_logs=logs({1: 1, 3: 12}))
    kill = PlannedKill(CrashPoint("fs", 0, 1), "write", 11, "rank 1: write", 0, 0, 3)
    assert count_shift(kill, planned, landed) == 2
    background = dc.replace(planned, ops=(dc.replace(planned.ops[0], tid=11),))
    assert count_shift(kill, background, landed) is None   # another thread's count: no anchor, nothing hit


def test_a_point_another_thread_reaches_by_count_is_not_delivered_by_count():
    from conformance.faults.delivery import AtOperation, CrashPointMissing
    view = _run([("write", "s/.tmp-main", "", "write", 10, False),     # main thread: write #1 to a temp name
                 ("write", "s/__1_0.distcp", "", "write", 11, False)])  # background writer: its write #1
    view = dataclasses.replace(view, ops=tuple(dataclasses.replace(o, nth=1) for o in view.ops))

    def at(k):
        return PlannedKill(CrashPoint("fs", k, 1), "write", 1, "rank 1: write", k, 0, 3)

    with pytest.raises(CrashPointMissing, match="another thread of the rank makes its write #1 too"):
        AtOperation(at(0), view, frozenset({"s/__1_0.distcp"}), Path("/ck"), job=True)
    assert not AtOperation(at(1), view, frozenset({"s/__1_0.distcp"}), Path("/ck"), job=True).counting()
    assert AtOperation(at(0), view, frozenset(), Path("/ck"), job=False).counting()   # one process: by count


def test_a_late_kill_shows_the_shift_at_the_planned_operation_itself():
    import dataclasses as dc

    from conformance.faults.shifts import count_shift
    planned = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-b", "", "write", 10, False)])
    planned = dc.replace(planned, ops=tuple(dc.replace(o, nth=n) for o, n in zip(planned.ops, (5, 6))))
    landed = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-c", "", "write", 10, False),
                   ("write", "s/d", "", "write", 10, True)])
    landed = dc.replace(landed, ops=tuple(dc.replace(o, nth=n) for o, n in zip(landed.ops, (3, 4, 6))))
    kill = PlannedKill(CrashPoint("fs", 1, 1), "write", 6, "rank 1: write", 1, 0, 3)
    assert count_shift(kill, planned, landed) == -2    # the target was this run's write #4, not #6


def test_a_job_fault_that_keeps_missing_by_a_few_calls_draws_another_point_but_a_divergence_fails():
    """gloo's wake-up writes can drift by more than the shifts catch up with: after the last
    attempt, a miss where the operations matched says nothing about the trainer (another point is
    drawn); operations that differ still fail it, and a single process gets no retry."""
    from conformance.faults.delivery import DELIVERY_ATTEMPTS, CrashNotLanded, CrashPointMissing, KillMissedCount, deliver
    kill = PlannedKill(CrashPoint("fs", 1, 1), "write", 6, "rank 1: write", 1, 0, 3)
    view = _run([("write", "s/a", "", "write", 10, False), ("write", "s/.tmp-b", "", "write", 10, False)])
    attempts = []

    def attempt(k):
        attempts.append(k.nth)
        return view

    def missing(k, landed):
        raise KillMissedCount("the killed run made 0 operation(s) before the kill, the planned run 1")

    def diverging(k, landed):
        raise CrashNotLanded("operation #0 differs")

    with pytest.raises(CrashPointMissing, match="deliveries by count missed"):
        deliver(kill, view, attempt, missing, job=True, shifted=True, reset=lambda: None)
    assert len(attempts) == DELIVERY_ATTEMPTS
    with pytest.raises(CrashNotLanded, match="differs") as raised:
        deliver(kill, view, attempt, diverging, job=True, shifted=True, reset=lambda: None)
    assert not isinstance(raised.value, CrashPointMissing)
    attempts.clear()
    with pytest.raises(KillMissedCount):
        deliver(kill, view, attempt, missing, job=False, shifted=False, reset=lambda: None)
    assert len(attempts) == 1


def test_a_count_the_main_threads_log_writes_also_reach_is_not_delivered_by_count():
    """A background writer's write #2 to a run-random temp file, and the main thread's write #2 (the
    loss log, not an operation under the checkpoint directory): whichever thread gets there first
    in a run takes the kill, so the point is not delivered by count (another is drawn)."""
    from conformance.faults.delivery import CrashPointMissing
    from conformance.faults.scenario import plan
    tmp = "/ck/.tmp-ckpt-1-4242"
    lines = [log(1), f'200  openat(AT_FDCWD</run>, "{tmp}", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 3<{tmp}>',
             f'200  write(3<{tmp}>, "a", 1) = 1', f'200  write(3<{tmp}>, "b", 1) = 1', log(2)]
    planned = recorded(lines, steps=2)
    assert ("write", 2) in planned.shared_counts
    second = next(k for k, i in enumerate(planned.mutations)
                  if planned.ops[i].kind == "write" and planned.ops[i].nth == 2)
    kill = plan(CrashPoint("fs", second), planned)
    with pytest.raises(CrashPointMissing, match="another thread of the rank makes its write #2 too"):
        choose_route(kill, planned, frozenset(), ROOT, LOG, job=True)
    assert choose_route(kill, planned, frozenset(), ROOT, LOG, job=False).counting()   # not threaded: by count
