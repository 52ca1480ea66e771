"""The conformance checks as a pytest base class. Subclass it with your adapter:

    from conformance import ResumeConformance

    class TestMyTrainer(ResumeConformance):
        adapter = "mypkg.train:ADAPTER"        # or trainer_cmd = "python train.py --small"

Every test's name is its check id (`test_<check id>`), so a team can select or xfail by id.
"""
from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, note, reject, seed, settings
from hypothesis import strategies as st

from . import checks
from .plugin import SEEDED_PROFILES
from .scenario import CrashPointMissing
from .crash import format_schedule
from .strategies import CADENCES, after_save_points, fs_points, in_save_points, schedules
from .tracing import strace_problem
from .trials import RunSpec

# Long enough for a checkpoint at a two-digit step with steps after it (ckpt-9 vs ckpt-12).
TOTAL_STEPS = 14
SEED = 0
_SLOW_OK = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture])


def _profile_seed(test):
    """Fix the seed under the gate profile (see plugin.py): same code, same draws, same verdict."""
    fixed = SEEDED_PROFILES.get(settings.get_current_profile_name())
    return test if fixed is None else seed(fixed)(test)


class ResumeConformance:
    """Generic conformance tests; the implementation under test is a class attribute or option."""

    adapter: ClassVar[object | None] = None
    trainer_cmd: ClassVar[str | None] = None

    # -- plumbing ---------------------------------------------------------------------------
    @pytest.fixture
    def session(self, request, conformance_session_for) -> checks.Session:
        return conformance_session_for(self.adapter, self.trainer_cmd)

    @staticmethod
    def spec(save_every: int = CADENCES[0]) -> RunSpec:
        return RunSpec(TOTAL_STEPS, save_every, SEED)

    @staticmethod
    def require_syscall_crash(session: checks.Session) -> None:
        if not session.adapter.has("syscall_crash"):
            pytest.skip("adapter lacks capability 'syscall_crash'")
        problem = strace_problem()
        if problem:
            pytest.skip(f"syscall-level crash injection unavailable: {problem}")

    @staticmethod
    def require_deterministic(session: checks.Session, spec: RunSpec) -> None:
        problem = session.determinism_problem(spec)
        if problem:
            pytest.skip("not deterministic without interruption (see determinism_precondition)")

    def _schedule_check(self, session, data, check: str, points) -> None:
        self.require_syscall_crash(session)
        spec = self.spec(data.draw(st.sampled_from(CADENCES), label="save_every"))
        self.require_deterministic(session, spec)
        baseline = session.baseline(spec)
        schedule = data.draw(points(baseline), label="schedule")
        note(f"schedule {format_schedule(schedule)}")
        try:
            checks.check_schedule(session, check, spec, schedule)
        except CrashPointMissing as exc:
            note(str(exc))
            reject()   # a later point that its process never reaches: draw another schedule

    # -- the checks ---------------------------------------------------------------------------
    def test_determinism_precondition(self, session):
        """Two uninterrupted runs agree; without this nothing else can be judged."""
        checks.check_determinism(session, self.spec())

    @_profile_seed
    @_SLOW_OK
    @given(data=st.data())
    def test_resume_matches_baseline(self, session, data):
        """After any crash schedule the run finishes (exit 0) on the uninterrupted loss curve."""
        self._schedule_check(session, data, "resume_matches_baseline", lambda b: schedules(b, max_crashes=2))

    @pytest.mark.parametrize("where", checks.CHECK_PARAMS["no_lost_work"])
    @_profile_seed
    @_SLOW_OK
    @given(data=st.data())
    def test_no_lost_work(self, session, data, where):
        """The trainer resumes from the newest checkpoint committed before the crash: killed
        between saves (is the newest one found?) or inside a save (is the previous one kept?)."""
        points = after_save_points if where == "between_saves" else \
            (lambda b: st.one_of(in_save_points(b), fs_points(b)))
        self._schedule_check(session, data, "no_lost_work", lambda b: points(b).map(lambda p: (p,)))

    @_profile_seed
    @_SLOW_OK
    @given(data=st.data())
    def test_no_torn_state(self, session, data):
        """After a kill inside a save, the checkpoint it resumes from is complete."""
        self._schedule_check(session, data, "no_torn_state", lambda b: in_save_points(b).map(lambda p: (p,)))

    def test_crash_states(self, session):
        """Every state a kill can leave during a run, rebuilt offline from one recording: the
        trainer resumes from the newest committed checkpoint and matches the baseline."""
        self.require_syscall_crash(session)
        spec = self.spec()
        self.require_deterministic(session, spec)
        checks.check_crash_states(session, spec)

    @pytest.mark.parametrize("kind", checks.CHECK_PARAMS["corruption_detected"])
    def test_corruption_detected(self, session, kind):
        """A truncated, bit-flipped or deleted file of the newest checkpoint is never loaded silently."""
        spec = self.spec()
        self.require_deterministic(session, spec)
        checks.check_corruption(session, spec, kind)

    def test_untrusted_checkpoint(self, session):
        """A checkpoint replaced by a code-running pickle must not run that code."""
        checks.check_untrusted(session, self.spec())

    def test_schema_migration(self, session):
        """Legacy-schema samples load, and the run resumes from them on the baseline curve."""
        if not session.adapter.has("legacy_samples"):
            pytest.skip("adapter lacks capability 'legacy_samples'")
        for sample in session.adapter.legacy_samples:
            checks.check_legacy_sample(session, self.spec(), sample)
