"""The storage-error and preemption checks judged as pure functions (`checks.storage.judge`,
`checks.preemption.judge`) on synthetic outcomes: one test per verdict, no process started."""
from __future__ import annotations

import pytest

from conformance.checks import preemption, storage
from conformance.faults.delivery import PlannedKill
from conformance.faults.injection import FaultOutcome
from conformance.model.process import ProcessResult
from tests.strategies import judged_fixture, never_plain, resumed_curve

# The fault hit write #4 of the save of step 9; the save of step 6 was committed before it.
SPEC, BASELINE, POINT, KILL = judged_fixture()


def curve(after: int, *, bent_at: int | None = None) -> dict[int, float]:
    return resumed_curve(BASELINE, after, bent_at=bent_at)


def outcome(first: ProcessResult, final: ProcessResult, kill: PlannedKill = KILL) -> FaultOutcome:
    return FaultOutcome(SPEC, POINT, "error=ENOSPC", kill, first, None, final)


def failed(code: int = 1, stderr: str = "OSError: [Errno 28] No space left on device: 'step-9'") -> ProcessResult:
    return ProcessResult(code, {k: v for k, v in BASELINE.items() if k <= 9}, stderr)


def resumed(after: int, **kw) -> ProcessResult:
    return ProcessResult(0, curve(after, **kw), "")


def io(o: FaultOutcome, synced_badly: str | None = None, same_as_plain=never_plain):
    found = storage.judge(o, "ENOSPC", BASELINE, 1e-4, synced_badly, same_as_plain=same_as_plain)
    return found and found[0]


def test_a_failed_save_that_exits_naming_the_error_and_resumes_from_the_committed_one_passes():
    assert io(outcome(failed(), resumed(6))) is None


def test_a_trainer_that_goes_on_training_past_a_failed_save_passes_if_the_next_start_is_right():
    went_on = ProcessResult(0, dict(BASELINE), "warning: save failed, will retry")
    assert storage.went_on(outcome(went_on, resumed(14)))
    assert io(outcome(went_on, resumed(14))) is None


@pytest.mark.parametrize("first, final, synced, expected", [
    (ProcessResult(0, {k: v for k, v in BASELINE.items() if k <= 9}, ""), resumed(6), None,
     "exited 0 at step 9 of 14: a failed save reported as success"),
    (failed(stderr="Traceback: RuntimeError: boom"), resumed(6), None, "exited 1 without naming the error on stderr"),
    (failed(), resumed(6), "step-00000009/model.pt", "committed a file whose fsync failed: step-00000009/model.pt"),
    (failed(), ProcessResult(1, {}, "EOFError"), None,
     "could not resume (exit 1) although the checkpoint of step 6 had been committed before the failure"),
    (failed(), resumed(3), None, "resumed from step 3: the checkpoint of step 6, committed before the failure, was lost"),
    (failed(), resumed(9, bent_at=10), None, "resumed from step 9 and diverges: it loaded the failed save"),
    (failed(), resumed(6, bent_at=8), None, "resumed from step 6 and diverges: it loaded damaged state"),
])
def test_each_way_a_failed_save_goes_wrong_is_named(first, final, synced, expected):
    problem = io(outcome(first, final), synced)
    assert problem and expected in problem, problem


def test_a_divergence_a_plain_resume_shares_is_not_blamed_on_the_fault():
    assert io(outcome(failed(), resumed(6, bent_at=8)), same_as_plain=lambda r, losses: r == 6) is None


def term(o: FaultOutcome, *, saves_on_term: bool = False, same_as_plain=never_plain):
    found = preemption.judge(o, BASELINE, 1e-4, saves_on_term=saves_on_term, grace_s=5, same_as_plain=same_as_plain)
    return found and found[0]


def sigtermed(code: int = 143, last: int = 9, stopped: str = "") -> ProcessResult:
    return ProcessResult(code, {k: v for k, v in BASELINE.items() if k <= last}, "", stopped=stopped)


def test_a_sigterm_then_a_resume_from_the_newest_committed_checkpoint_passes():
    assert term(outcome(sigtermed(), resumed(6))) is None
    # A trainer that saves on SIGTERM resumes from the last step it logged.
    assert term(outcome(sigtermed(last=10), resumed(10)), saves_on_term=True) is None
    # SIGTERM in the last step, and the run finished: completed, no final checkpoint required.
    assert term(outcome(sigtermed(code=0, last=14), resumed(12)), saves_on_term=True) is None


@pytest.mark.parametrize("first, final, saves, expected", [
    (sigtermed(code=0, last=10), resumed(9), False, "exited 0 at step 10 of 14: a scheduler"),
    (sigtermed(stopped="grace period"), resumed(9), True, "still running 5 s after SIGTERM"),
    (sigtermed(), ProcessResult(1, {}, "EOFError"), False, "could not resume (exit 1)"),
    (sigtermed(), resumed(3), False, "resumed from step 3, older than the checkpoint of step 6 committed before it"),
    (sigtermed(last=10), resumed(9), True, "it had logged step 10 when it exited, but the next start resumed from step 9"),
    (sigtermed(), resumed(6, bent_at=8), False, "resumed from step 6 and diverges: it loaded incomplete state"),
])
def test_each_way_a_preemption_goes_wrong_is_named(first, final, saves, expected):
    problem = term(outcome(first, final), saves_on_term=saves)
    assert problem and expected in problem, problem


def test_a_trainer_that_goes_on_without_the_failed_save_fails_naming_the_lost_step():
    went_on = ProcessResult(0, dict(BASELINE), "warning: background save failed, continuing")
    problem = io(outcome(went_on, resumed(6)))
    assert problem and "a failed save passed silently" in problem and "the save of step 9 was never committed" in problem


def test_a_trainer_that_goes_on_and_commits_the_failed_step_by_a_retry_passes():
    went_on = ProcessResult(0, dict(BASELINE), "warning: save failed, retried")
    assert io(outcome(went_on, resumed(9))) is None
