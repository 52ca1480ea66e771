"""The conformance checks as a pytest base class. Subclass it with your adapter:

    from conformance import ResumeConformance

    class TestMyTrainer(ResumeConformance):
        adapter = "mypkg.train:ADAPTER"        # or trainer_cmd = "python train.py --small"

Its test methods are made from the check registry (checks/registry.py): `test_<check id>`, with
`[param]` for parameterised checks, so a team can select or xfail by id.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import warnings
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given, note, reject, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from .checks import CHECKS, Check, Session, skip_reason
from .checks.failures import CheckNotApplicable, ConformanceFailure
from .checks.registry import case_text
from .faults.scenario import CrashNotLanded, CrashPointMissing, plan
from .model import evidence
from .model.crash import CrashPoint
from .model.process import RunSpec
from .model.settings import CADENCES, REPLAYS_PER_RUNNER, SEED, SEEDED_PROFILES, SLOW_OK, suite_profile
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
        self.warm_runs: tuple[bool, ...] = (True,)   # the warm runs of its case so far, each failed (True) or passed


class RunnerDisagreementWarning(UserWarning):
    """The warm runner failed a case every time and a fresh interpreter per process passed it every time."""



# What a race in a trainer usually is, named when the runs show none of them.
RACE_CANDIDATES = ("a commit point or pointer written before another rank (or thread) finished its part, with no "
                   "barrier between them", "a commit racing the kill (what the other ranks write before the job is "
                   "stopped varies)", "a background write racing the next step or the next start",
                   "state or data order that depends on timing")


class Interpreter(enum.Enum):
    """Where a replay ran: the session's warm runner, or its fresh twin (an interpreter per process)."""
    WARM = "warm"
    FRESH = "fresh"


class Outcome(enum.Enum):
    FAILED = "failed"
    PASSED = "passed"
    UNDELIVERED = "undelivered"   # its fault could not be landed where planned: says nothing of the trainer
    NO_CASE = "no such case"      # the replay's run has no such case (CrashPointMissing, CheckNotApplicable)


@dataclasses.dataclass(frozen=True)
class Replay:
    """One more run of a failing case, with what it recorded of its trials."""
    where: Interpreter
    outcome: Outcome
    detail: str = ""                               # why it failed or could not be delivered: the first line
    trials: tuple[evidence.Trial, ...] = ()


class Verdict(enum.Enum):
    CONFIRMED = "confirmed"                 # every run failed: the trainer's
    INTERMITTENT = "intermittent"           # failed again in some replay, passed in another: the trainer's race
    DISAGREEMENT = "runner disagreement"    # every warm run failed, every fresh replay passed: the suite's
    NOT_REPRODUCIBLE = "not reproducible"   # only the run that found it failed


def settle(warm: Sequence[bool], fresh: Sequence[bool]) -> Verdict:
    """What the delivered runs of one failing case say: `warm` the warm runner's (the first is the run
    that found the failure, so True), `fresh` the fresh interpreter's, each True where it failed.
    A failure that comes back in either runner is the trainer's; only one every warm run repeats and
    no fresh replay does is the warm runner's own."""
    if all(warm) and fresh and all(fresh):
        return Verdict.CONFIRMED
    if any(fresh):
        return Verdict.INTERMITTENT
    if len(warm) > 1 and all(warm):
        return Verdict.DISAGREEMENT if fresh else Verdict.CONFIRMED
    return Verdict.INTERMITTENT if any(warm[1:]) else Verdict.NOT_REPRODUCIBLE


def _replay(check: Check, session: Session, spec: RunSpec, param: str | None, case: object,
            where: Interpreter) -> Replay:
    """The case run once more in `session`; its evidence is taken (it is not the test's own)."""
    try:
        check.decide(session, spec, param, case)
    except CrashNotLanded as exc:
        if check.draw is not None:   # as in the test itself: a miss says nothing of the trainer
            return Replay(where, Outcome.UNDELIVERED, str(exc).splitlines()[0], _trials())
        return Replay(where, Outcome.FAILED, str(exc).splitlines()[0], _trials())
    except ConformanceFailure as exc:
        return Replay(where, Outcome.FAILED, str(exc).splitlines()[0], _trials())
    except (CrashPointMissing, CheckNotApplicable) as exc:
        return Replay(where, Outcome.NO_CASE, str(exc).splitlines()[0], _trials())
    return Replay(where, Outcome.PASSED, "", _trials())


def _trials() -> tuple[evidence.Trial, ...]:
    return tuple(e for e in evidence.take() if isinstance(e, evidence.Trial))


def _next_start(resumed_from: int) -> str:
    return "could not start" if resumed_from < 0 else f"resumed from step {resumed_from}"


def _commit_raced_kill(replays: Sequence[Replay]) -> str:
    """The evidence that a kill inside a save left a directory the next start treated differently in
    failing and in passing runs of the one case: what the rest of the job (other ranks, other
    threads) wrote between the kill and the job's end varied."""
    seen: dict[bool, dict[int, evidence.CrashRecord]] = {True: {}, False: {}}
    for replay in replays:
        if replay.outcome in (Outcome.FAILED, Outcome.PASSED) and replay.trials:
            for crash in replay.trials[-1].crashes:
                if crash.inside_save_of:
                    seen[replay.outcome is Outcome.FAILED].setdefault(crash.resumed_from, crash)
    if not seen[True] or not seen[False] or set(seen[True]) & set(seen[False]):
        return ""
    crash = next(iter(seen[True].values()))
    after = " and ".join(" or ".join(_next_start(r) for r in sorted(seen[failing]))
                         + f" after {'failing' if failing else 'passing'} runs" for failing in (True, False))
    return (f"a commit racing the kill: the same kill ({crash.point}: {crash.planned}, inside the save of step "
            f"{crash.inside_save_of}) left a directory the next job treated differently (it {after}), so what "
            "the rest of the job wrote between the kill and its end varied")


def _pointer_before_peers(session: Session, spec: RunSpec, case: object) -> str:
    """The evidence, in the uninterrupted run the case's first kill was planned on, that another rank
    ended its part of a save by renaming (or linking) a file into place before the killed rank had
    finished its part of that save: nothing ordered them (the save the kill interrupts is looked at
    first, then the others: one code path writes them all)."""
    first = case[0] if isinstance(case, tuple) and case else case
    if not isinstance(first, CrashPoint) or spec.world_size < 2:
        return ""
    point = first.bound(spec.ranks_per_node)
    try:
        baseline = session.baseline(spec)
        kill = plan(point, baseline)
    except Exception:   # the evidence is a hint; the verdict never depends on it
        return ""
    if kill is None or not baseline.is_job:
        return ""
    windows = baseline.windows()
    for save in sorted((s for s in windows if s), key=lambda s: s != kill.in_progress):
        ops = [baseline.ops[i] for i in windows[save]]
        mine = [op for op in ops if op.rank == point.on_rank]
        for rank in sorted({op.rank for op in ops} - {point.on_rank}):
            theirs = [op for op in ops if op.rank == rank and op.kind != "fsync"]
            if mine and theirs and theirs[-1].kind in ("rename", "link", "symlink") and theirs[-1].index < mine[-1].index:
                return (f"a pointer written before a barrier, if that {theirs[-1].kind} is the save's pointer or "
                        f"commit point: in the uninterrupted run, rank {rank} ended its part of the save of step "
                        f"{save} with `{theirs[-1].describe()}` before rank {point.on_rank} had finished its part "
                        f"(its last operation, `{mine[-1].describe()}`, came after), so nothing in that run ordered "
                        f"them; a file it publishes then can name a save rank {point.on_rank} has not finished (a "
                        "rank renaming only its own shard into place is no such race)")
    return ""


def race_shape(session: Session, spec: RunSpec, case: object, replays: Sequence[Replay]) -> str:
    """The race's likely shape, claimed only where the runs show it; else "cannot tell" and the candidates."""
    found = [s for s in (_pointer_before_peers(session, spec, case), _commit_raced_kill(replays)) if s]
    if found:
        return "; ".join(found)
    return "cannot tell from these runs; the usual shapes: " + "; ".join(RACE_CANDIDATES)


def _confirmed(request, session: Session, check: Check, param: str | None, failed: CheckFailed) -> None:
    """Raise `failed` unless replays show the warm runner's own problem. Its case is replayed in a
    fresh interpreter per process; where that passes, REPLAYS_PER_RUNNER more times in each runner.
    `failed.warm_runs`: the warm runs of the case so far (a passing one: Hypothesis's own repeat).
    A failure that comes back in either runner fails the check as intermittent, with every run's
    outcome and the race's likely shape; one that never comes back fails it as not reproducible.
    Only a failure every warm run repeats and no fresh replay does is the suite's problem: a runner
    disagreement, recorded (the report counts it), warned about, and never the trainer's failure.
    Paid only on failure."""
    twin = session.fresh_twin()
    if twin is None:   # the runner starts fresh interpreters already
        raise failed
    if option(request.config, "confirm") == "off":
        failed.msg += "\n  not confirmed in a fresh interpreter (--confirm=off)"
        raise failed
    spec = getattr(failed.cause, "spec", None) or failed.spec
    named = getattr(failed.cause, "case", None) or {}
    case = check.case.parse(named[check.case.name]) if check.case and check.case.name in named else failed.case
    recorded = evidence.take()   # the replays' own evidence is not this test's
    replays: list[Replay] = []
    try:
        replays.append(_replay(check, twin, spec, param, case, Interpreter.FRESH))
        if replays[0].outcome is Outcome.NO_CASE:
            failed.msg += f"\n  not confirmed: a fresh interpreter's run has no such case ({replays[0].detail})"
            raise failed from None
        if replays[0].outcome is not Outcome.FAILED:
            for _ in range(REPLAYS_PER_RUNNER):
                replays.append(_replay(check, twin, spec, param, case, Interpreter.FRESH))
                replays.append(_replay(check, session, spec, param, case, Interpreter.WARM))
    finally:
        evidence.take()
        for item in recorded:
            evidence.record(item)
    delivered = [r for r in replays if r.outcome in (Outcome.FAILED, Outcome.PASSED)]
    runs = {where: tuple(r.outcome is Outcome.FAILED for r in delivered if r.where is where) for where in Interpreter}
    warm_runs, fresh_runs = failed.warm_runs + runs[Interpreter.WARM], runs[Interpreter.FRESH]
    verdict = settle(warm_runs, fresh_runs)
    text = case_text(check, case) if check.case and case is not None else ""
    name = check.id + (f"[{param}]" if param else "")
    found = evidence.Intermittent(check=name, case=text, warm=warm_runs, fresh=fresh_runs,
                                  undelivered=len(replays) - len(delivered))
    if verdict is Verdict.CONFIRMED:
        failed.msg += ("\n  confirmed: a fresh interpreter per process fails this case too" if len(replays) == 1 else
                       f"\n  confirmed: every run of this case that was delivered failed ({found.outcomes()})")
        raise failed from None
    if verdict is Verdict.DISAGREEMENT:
        disagreement = evidence.RunnerDisagreement(
            check=name, case=text, warm=str(failed.msg),
            fresh=f"passed the same case {len(fresh_runs)} of {len(fresh_runs)} times, while the warm runner failed "
                  f"it {len(warm_runs)} of {len(warm_runs)}")
        evidence.record(disagreement)
        warnings.warn(RunnerDisagreementWarning(disagreement.summary() + "\n" + failed.msg), stacklevel=1)
        return
    found = dataclasses.replace(found, shape=race_shape(session, spec, case, replays))
    evidence.record(found)
    failed.msg += "\n" + _settled_text(found)
    raise failed from None


def _settled_text(found: evidence.Intermittent) -> str:
    """The lines a failure settled by repetition ends with (each sentence true of `found`)."""
    head = f"failed {found.failed} of {found.runs} runs of this one case ({found.outcomes()})"
    if found.reproduced:
        if any(found.fresh):
            where = ("the fresh interpreter and the warm runner" if any(found.warm[1:]) else "the fresh interpreter") \
                + ", so it is the trainer's failure, not the runner's"
        else:
            where = ("the warm runner only, not reliably (a warm-only artifact of the runner repeats every time); a race "
                     "shows in either runner, and nothing shows the runner made this one, so it is failed as the "
                     "trainer's")
        return (f"  intermittent: {head}. A verdict that changes between runs of the same case is a race; it came "
                f"back in {where}\n  race:     {found.shape}")
    return (f"  not reproducible: {head}. Either a race in the trainer that these runs did not hit again, or a "
            "one-off fault of the suite's warm runner: the suite cannot tell which, and nothing shows it was the "
            "suite's, so the failure stands as found (its replay line runs the case again)"
            f"\n  race:     if it is one, {found.shape}")


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
        except CheckNotApplicable as exc:
            # Nothing of the trainer was judged (every state it left was one the suite cannot
            # rebuild, or a migration the run does not need): a skip that says so, never a pass.
            pytest.skip(str(exc))
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
        failed.warm_runs = (True, False)
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
