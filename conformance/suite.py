"""The conformance checks as a pytest base class. Subclass it with your adapter:

    from conformance import ResumeConformance

    class TestMyTrainer(ResumeConformance):
        adapter = "mypkg.train:ADAPTER"        # or trainer_cmd = "python train.py --small"

Its test methods are made from the check registry (checks/registry.py): `test_<check id>`, with
`[param]` for parameterised checks, so a team can select or xfail by id.
"""
from __future__ import annotations

import difflib
import warnings
from typing import ClassVar

import pytest
from hypothesis import given, note, reject, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from .checks import CHECKS, Check, Session, skip_reason
from .checks.failures import CheckNotApplicable, ConformanceFailure
from .checks.registry import case_text
from .faults.scenario import CrashNotLanded, CrashPointMissing
from .model import evidence
from .model.process import RunSpec
from .model.settings import CADENCES, SEED, SEEDED_PROFILES, SLOW_OK, suite_profile
from .options import option

ACCEPTED_ATTRIBUTES = ("adapter", "trainer_cmd", "world_size", "nnodes")


def _profile_seed(test):
    """The suite's own profile (suite_profile), and its fixed seed where it has one: same code,
    same draws, same verdict."""
    name = suite_profile(settings.get_current_profile_name())
    test = settings(settings.get_profile(name), **SLOW_OK)(test)
    fixed = SEEDED_PROFILES.get(name)
    return test if fixed is None else seed(fixed)(test)


class ResumeConformance:
    """Generic conformance tests; the trainer under test is a class attribute (`adapter` or
    `trainer_cmd`), or the suite's options when `configured_by_options` is set."""

    adapter: ClassVar[object | None] = None
    trainer_cmd: ClassVar[str | None] = None
    world_size: ClassVar[int | None] = None   # ranks under torchrun (default: the adapter's, or 1)
    nnodes: ClassVar[int | None] = None       # torchrun agents the ranks spread over (default: the adapter's, or 1)
    configured_by_options: ClassVar[bool] = False

    @pytest.fixture
    def session(self, conformance_session_for) -> Session:
        if self.configured_by_options and self.adapter is None and self.trainer_cmd is None:
            return conformance_session_for(None, None, self.world_size, self.nnodes)
        return conformance_session_for(self.adapter, self.trainer_cmd, self.world_size, self.nnodes)

    @classmethod
    def conformance_problem(cls) -> str | None:
        """What is wrong with how this subclass names its trainer (a usage error), or None."""
        if cls.__name__ == "ResumeConformance" and cls.__module__ == __name__:
            return None
        own = {k for c in cls.__mro__ if c is not ResumeConformance and c is not object for k in vars(c)}
        for name in sorted(own):
            if name in ACCEPTED_ATTRIBUTES or name.startswith("_") or name.startswith("test"):
                continue
            close = difflib.get_close_matches(name, ACCEPTED_ATTRIBUTES, n=1, cutoff=0.7)
            if close:
                return (f"{cls.__module__}.{cls.__qualname__} sets {name!r}, which the suite does not read: "
                        f"did you mean {close[0]!r}?\n  fix: rename the class attribute {name!r} to {close[0]!r}")
        if cls.adapter is None and cls.trainer_cmd is None and not cls.configured_by_options:
            return (f"{cls.__module__}.{cls.__qualname__} names no trainer\n  fix: set the class attribute "
                    "'adapter' (\"package.module:attribute\") or 'trainer_cmd' (\"python train.py ...\")")
        if cls.adapter is not None and cls.trainer_cmd is not None:
            return (f"{cls.__module__}.{cls.__qualname__} sets both 'adapter' and 'trainer_cmd'\n"
                    "  fix: keep one of the two class attributes")
        return None


def _spec(session: Session, save_every: int = CADENCES[0]) -> RunSpec:
    adapter = session.adapter
    return RunSpec(adapter.total_steps, save_every, SEED, adapter.world_size, nnodes=adapter.nnodes,
                   node_local=adapter.has("node_local_storage"),
                   cold=session.cold if session.adapter.has("cold_tier") else None)


class CheckFailed(pytest.fail.Exception):
    """A check's failure as pytest reports it (the report is the message), with the case that
    failed: what a confirmation in a fresh interpreter replays."""

    def __init__(self, report: str, cause: BaseException, spec: RunSpec, case: object):
        super().__init__(report, pytrace=False)
        self.cause, self.spec, self.case = cause, spec, case


class RunnerDisagreementWarning(UserWarning):
    """The warm runner failed a case that a fresh interpreter per process passed."""


def _confirmed(request, session: Session, check: Check, param: str | None, failed: CheckFailed) -> None:
    """Raise `failed` unless a replay of its case in a fresh interpreter per process passes; then
    the warm runner did not stand in for a real restart, which is the suite's problem: recorded
    (the report counts it), warned about, and never the trainer's failure. Paid only on failure."""
    twin = session.fresh_twin()
    if twin is None:   # the runner starts fresh interpreters already
        raise failed
    if option(request.config, "confirm") == "off":
        failed.msg += "\n  not confirmed in a fresh interpreter (--confirm=off)"
        raise failed
    spec = getattr(failed.cause, "spec", None) or failed.spec
    named = getattr(failed.cause, "case", None) or {}
    case = check.case.parse(named[check.case.name]) if check.case and check.case.name in named else failed.case
    recorded = evidence.take()   # the replay's own evidence is not this test's
    try:
        check.decide(twin, spec, param, case)
    except (ConformanceFailure, CrashNotLanded):
        failed.msg += "\n  confirmed: a fresh interpreter per process fails this case too"
        raise failed from None
    except (CrashPointMissing, CheckNotApplicable) as exc:
        failed.msg += f"\n  not confirmed: a fresh interpreter's run has no such case ({exc})"
        raise failed from None
    finally:
        evidence.take()
        for item in recorded:
            evidence.record(item)
    text = case_text(check, case) if check.case and case is not None else ""
    disagreement = evidence.RunnerDisagreement(check=check.id + (f"[{param}]" if param else ""), case=text,
                                               warm=str(failed.msg), fresh="passed the same case")
    evidence.record(disagreement)
    warnings.warn(RunnerDisagreementWarning(disagreement.summary() + "\n" + failed.msg), stacklevel=1)


def _make_test(check: Check):
    def run(request, session: Session, param: str | None, data=None) -> None:
        spec = _spec(session, data.draw(st.sampled_from(CADENCES), label="save_every") if check.draw else CADENCES[0])
        reason = skip_reason(check, session, spec)
        if reason:
            pytest.skip(reason)
        case = None
        if check.draw is not None:
            try:
                cases = check.draw(session.baseline(spec), param)
            except CheckNotApplicable as exc:
                pytest.skip(str(exc))
            case = data.draw(cases, label=check.case.name)
            note(f"{check.case.name} {case_text(check, case)}")
        failure = None
        try:
            check.decide(session, spec, param, case)
        except CrashPointMissing as exc:
            note(str(exc))
            if check.draw is not None:
                evidence.drawn(False, str(exc).splitlines()[0])
            reject()   # a later point that its process never reaches: draw another schedule
        except (ConformanceFailure, CrashNotLanded) as exc:
            if isinstance(exc, CrashNotLanded) and check.draw is not None:
                # A fault the suite could not land where it planned says nothing of the trainer
                # (whether its operations repeat is determinism_precondition's to judge, from two
                # whole runs): another point is drawn, and the report counts the undelivered ones.
                note(str(exc))
                evidence.drawn(False, str(exc).splitlines()[0])
                reject()
            if request.config.getoption("verbose") >= 2:
                raise   # -vv: the suite's own frames too
            failure = exc
        if check.draw is not None:
            evidence.drawn(True)
        if failure is not None:   # outside the except block: no "during handling" chain, no second copy
            raise CheckFailed(str(failure), failure, spec, case)   # the report is the message; the suite's source is noise

    if check.draw is None and check.params:
        def drawn(self, request, session, param):
            run(request, session, param)
    elif check.draw is None:
        def drawn(self, request, session):
            run(request, session, None)
    elif check.params:
        @_profile_seed
        @given(data=st.data())
        def drawn(self, request, session, param, data):
            run(request, session, param, data)
    else:
        @_profile_seed
        @given(data=st.data())
        def drawn(self, request, session, data):
            run(request, session, None, data)
    if check.params:
        def test(self, request, session, param):
            _run_confirmed(drawn, check, self, request, session, param)
    else:
        def test(self, request, session):
            _run_confirmed(drawn, check, self, request, session, None)
    if hasattr(drawn, "hypothesis"):   # pytest's Hypothesis plugin sees the drawn test through it
        test.hypothesis = drawn.hypothesis
    test.__name__ = f"test_{check.id}"
    test.__qualname__ = f"ResumeConformance.test_{check.id}"
    test.__doc__ = check.summary
    if check.params:
        test = pytest.mark.parametrize("param", check.params)(test)
    return test


def _run_confirmed(drawn, check: Check, self, request, session: Session, param: str | None) -> None:
    """`drawn` (Hypothesis's test, or the plain one), then its reported failure confirmed once in
    a fresh interpreter; under Hypothesis, only the failure it reports after shrinking."""
    try:
        drawn(self, request, session, *([param] if check.params else []))
    except CheckFailed as failed:
        _confirmed(request, session, check, param, failed)
    except FlakyFailure as flaky:
        failed = first_check_failure(flaky)
        if failed is None:   # the suite's own error that did not repeat: Hypothesis's report says it all
            raise
        failed.msg += ("\n  not repeated: Hypothesis ran this case again in the same runner and it passed (a "
                       "verdict that changes from run to run: a race in the trainer, or in the suite)")
        _confirmed(request, session, check, param, failed)


def first_check_failure(flaky: FlakyFailure) -> CheckFailed | None:
    """The check's failure Hypothesis saw first in `flaky` (it wraps a pytest outcome, which is a
    BaseException, in an exception of its own), or None when the group holds none."""
    for exc in flaky.exceptions:
        for candidate in (exc, exc.__cause__):
            if isinstance(candidate, CheckFailed):
                return candidate
            if isinstance(candidate, FlakyFailure):
                inner = first_check_failure(candidate)
                if inner is not None:
                    return inner
    return None


for _check in CHECKS:
    setattr(ResumeConformance, f"test_{_check.id}", _make_test(_check))
