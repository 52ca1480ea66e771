"""Save triggers (reference/loop/triggers.py): exact decisions on a fake clock, purity of decide(), min-interval
and forced saves, typed errors, and a resumed run deciding exactly as an uninterrupted one."""
from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_conformance.reference.loop.triggers import (
    Decision,
    TriggerStateError,
    any_of,
    every_seconds,
    every_steps,
    forced_only,
    hybrid,
    on_metric,
)

from tests.strategies import FakeClock


def _json(obj):
    return json.loads(json.dumps(obj, allow_nan=False))


# -- every_steps / every_seconds ---------------------------------------------------------------

def test_every_steps_saves_multiples_and_never_step_zero():
    t = every_steps(3)
    assert [step for step in range(11) if t.decide(step).save] == [3, 6, 9]
    assert t.decide(12) == Decision(True, ("every_steps(3)",), False, None, 12, None)
    forced = every_steps(3).decide(0, force=True)
    assert forced.save and forced.reasons == ("forced",)


def test_decide_is_pure_and_a_failed_save_changes_nothing():
    clock = FakeClock()
    t = any_of(every_seconds(60, clock=clock), on_metric("loss"))
    before = t.state_dict()
    clock.now += 60
    first = t.decide(5, {"loss": 1.0})
    assert first.save and t.state_dict() == before
    assert t.decide(5, {"loss": 1.0}) == first          # the save failed: decided again, alike
    t.committed(first)
    assert t.state_dict() != before
    assert not t.decide(6, {"loss": 1.0}).save


def test_every_seconds_counts_from_the_last_save_on_a_fake_clock():
    clock = FakeClock(1000.0)
    t = every_seconds(60, clock=clock)
    clock.now = 1059.5
    assert not t.decide(1).save
    clock.now = 1060.0                                   # >= seconds
    d = t.decide(2)
    assert d.save and d.time == 1060.0 and d.reasons == ("every_seconds(60): 60s since start",)
    t.committed(d)
    assert t.state_dict() == {"kind": "every_seconds", "last_saved_step": 2, "started_at": 1000.0,
                              "last_saved_time": 1060.0}
    clock.now = 1119.0
    assert not t.decide(3).save
    clock.now = 1120.0
    assert t.decide(4).reasons == ("every_seconds(60): 60s since last save",)


def test_every_seconds_any_save_restarts_the_interval():
    clock = FakeClock(0.0)
    t = any_of(every_steps(10), every_seconds(100, clock=clock))
    clock.now = 90.0
    t.committed(t.decide(10))
    clock.now = 150.0                                     # 150 since start, but 60 since the save
    assert not t.decide(11).save
    clock.now = 190.0
    assert t.decide(12).save


def test_every_seconds_defaults_to_wall_time_and_a_resume_keeps_the_last_save_time():
    t = every_seconds(5)
    assert t.clock is time.time and abs(t.state_dict()["started_at"] - time.time()) < 60
    clock = FakeClock(1000.0)
    first = every_seconds(600, clock=clock)
    clock.now = 1700.0
    d = first.decide(7)
    record = _json(first.record(d))
    first.committed(d)
    clock.now = 2000.0                                    # a new process, 300 s after the save
    resumed = every_seconds(600, clock=clock)
    resumed.load_state_dict(record["state"])
    clock.now = 2299.0
    assert not resumed.decide(8).save
    clock.now = 2300.0                                    # 600 s after the save, not after the restart
    assert resumed.decide(9).save


def test_a_clock_set_back_counts_as_the_interval_passed():
    clock = FakeClock(1000.0)
    t = every_seconds(60, clock=clock)
    clock.now = 1100.0
    t.committed(t.decide(1))
    clock.now = 500.0
    assert t.decide(2).reasons == ("every_seconds(60): the clock reads 600s before the last save",)
    t = hybrid(60, on_metric("loss"), min_interval_s=600, clock=clock)
    t.committed(t.decide(1, {"loss": 1.0}))
    clock.now = 100.0
    assert t.decide(2, {"loss": 0.5}).save                # not held back until the clock catches up


# -- on_metric ---------------------------------------------------------------------------------

def test_on_metric_min_saves_improvements_against_the_best_saved_value():
    t = on_metric("val_loss", min_delta=0.1)
    d = t.decide(1, {"val_loss": 0.9})
    assert (d.save, d.best, d.metric, d.reasons) == (True, True, 0.9, ("metric:val_loss first value 0.9",))
    t.committed(d)
    assert not t.decide(2, {"val_loss": 0.85}).save      # better, but not by more than min_delta
    assert not t.decide(3, {"val_loss": 0.9 - 0.1}).save  # by exactly min_delta: not more
    d = t.decide(4, {"val_loss": 0.7})
    assert d.save and d.best and d.reasons == ("metric:val_loss improved 0.9 -> 0.7",)
    again = t.decide(5, {"val_loss": 0.75})              # 0.7 was not committed: the best saved is 0.9
    assert again.save and again.reasons == ("metric:val_loss improved 0.9 -> 0.75",)
    t.committed(d)
    assert t.state_dict()["best"] == 0.7
    assert not t.decide(5, {"val_loss": 0.75}).save and not t.decide(5, {"val_loss": 0.75}).best


def test_on_metric_max_absent_nan_and_infinite_values():
    t = on_metric("acc", mode="max")
    for metrics in (None, {}, {"other": 1.0}, {"acc": None}):
        d = t.decide(1, metrics)
        assert (d.save, d.metric, d.reasons) == (False, None, ())
    for bad in (math.nan, math.inf, -math.inf):
        d = t.decide(1, {"acc": bad})
        assert not d.save and not d.best
    t.committed(t.decide(1, {"acc": 0.5}))
    assert not t.decide(2, {"acc": 0.4}).save and not t.decide(2, {"acc": 0.5}).save
    assert t.decide(2, {"acc": 0.51}).save
    with pytest.raises(ValueError, match=r"metrics\['acc'\] must be a real number, got 'high'"):
        t.decide(3, {"acc": "high"})


def test_a_save_for_another_reason_with_a_better_metric_becomes_the_best():
    t = any_of(every_steps(10), on_metric("loss", min_delta=0.5))
    t.committed(t.decide(1, {"loss": 2.0}))
    d = t.decide(10, {"loss": 1.9})                       # saved by steps; better, under min_delta
    assert d.reasons == ("every_steps(10)",) and d.best and d.metric == 1.9
    t.committed(d)
    assert t.state_dict()["children"][1]["best"] == 1.9
    d = t.decide(20, {"loss": 5.0})                       # saved by steps, worse: the best stays
    assert d.save and not d.best
    t.committed(d)
    assert t.state_dict()["children"][1]["best"] == 1.9
    assert not t.decide(21, {"loss": 1.5}).save           # 0.4 better than 1.9: not enough
    assert t.decide(22, {"loss": 1.3}).reasons == ("metric:loss improved 1.9 -> 1.3",)


def test_forced_only_never_fires_but_saves_when_forced():
    never = forced_only()
    assert repr(never) == "forced_only()" and repr(any_of()) == "forced_only()"
    assert not any(never.decide(step).save for step in range(300))
    d = never.decide(7, force=True)
    assert d.save and d.reasons == ("forced",)
    never.committed(d)
    assert _json(never.record(d))["state"] == never.state_dict() == {"kind": "any_of", "last_saved_step": 7,
                                                                      "children": []}


# -- hybrid, forced saves ----------------------------------------------------------------------

def test_hybrid_time_or_event_with_min_interval():
    clock = FakeClock(0.0)
    t = hybrid(7200, on_metric("val_loss"), min_interval_s=600, clock=clock)
    assert repr(t) == "hybrid(every_seconds(7200), on_metric('val_loss', min), min_interval=600s)"
    clock.now = 10.0
    d = t.decide(1, {"val_loss": 0.5})
    assert d.save and d.best
    t.committed(d)
    clock.now = 310.0
    d = t.decide(2, {"val_loss": 0.4})                    # improved, but 300 s after the last save
    assert not d.save and not d.best and d.metric == 0.4
    assert d.reasons == ("metric:val_loss improved 0.5 -> 0.4",)
    assert d.held == "min_interval 600s: 300s since last save"
    clock.now = 610.0
    d = t.decide(3, {"val_loss": 0.45})                  # worse than 0.4 seen, better than 0.5 saved
    assert d.save and d.best and d.reasons == ("metric:val_loss improved 0.5 -> 0.45",)
    t.committed(d)
    clock.now = 610.0 + 7200
    d = t.decide(4, {"val_loss": 0.9})
    assert d.save and not d.best and d.reasons == ("every_seconds(7200): 7200s since last save",)


def test_forced_save_bypasses_min_interval_and_the_same_step_rule():
    clock = FakeClock(0.0)
    t = hybrid(every_seconds(3600, clock=clock), any_of(every_steps(100), on_metric("loss")),
               min_interval_s=600)
    t.committed(t.decide(100, {"loss": 1.0}))
    clock.now = 5.0
    held = t.decide(200, {"loss": 0.5})
    assert not held.save and held.held.startswith("min_interval")
    d = t.decide(200, {"loss": 0.5}, force=True)
    assert d.save and d.best and d.held is None
    assert d.reasons == ("forced", "every_steps(100)", "metric:loss improved 1 -> 0.5")
    t.committed(d)
    clock.now = 5000.0
    again = t.decide(200, {"loss": 0.1})                 # the step already saved
    assert not again.save and again.held == "step 200 already saved"
    assert t.decide(200, force=True).save
    record = _json(t.record(d))
    assert record["reasons"][0] == "forced" and record["best"] is True and record["step"] == 200


def test_committed_and_record_refuse_a_decision_not_to_save():
    t = every_steps(5)
    for bad in (t.decide(1), {"save": True}):
        for method in (t.committed, t.record):
            with pytest.raises(ValueError, match=r"take a decide\(\) Decision to save"):
                method(bad)


# -- arguments, describe -----------------------------------------------------------------------

_SHARED = every_steps(2)


@pytest.mark.parametrize("make, message", [
    (lambda: every_steps(0), r"n must be an integer >= 1, got 0"),
    (lambda: every_steps(-3), r"n must be an integer >= 1, got -3"),
    (lambda: every_steps(2.0), r"n must be an integer >= 1, got 2\.0"),
    (lambda: every_steps(True), r"n must be an integer >= 1, got True"),
    (lambda: every_seconds(0), r"seconds must be a finite number > 0, got 0"),
    (lambda: every_seconds(-1.5), r"seconds must be a finite number > 0, got -1\.5"),
    (lambda: every_seconds(math.nan), r"seconds must be a finite number > 0, got nan"),
    (lambda: every_seconds(math.inf), r"seconds must be a finite number > 0, got inf"),
    (lambda: every_seconds(60, clock=3), r"clock must be a callable"),
    (lambda: on_metric(""), r"name must be a non-empty string, got ''"),
    (lambda: on_metric(None), r"name must be a non-empty string, got None"),
    (lambda: on_metric("loss", mode="median"), r"mode must be 'min' or 'max', got 'median'"),
    (lambda: on_metric("loss", min_delta=-0.1), r"min_delta must be a finite number >= 0, got -0\.1"),
    (lambda: on_metric("loss", min_delta=math.nan), r"min_delta must be a finite number >= 0, got nan"),
    (lambda: hybrid(60, every_steps(1), min_interval_s=-1), r"min_interval_s must be a finite number >= 0, got -1"),
    (lambda: hybrid(0, every_steps(1)), r"time_trigger_or_seconds .* must be a finite number > 0, got 0"),
    (lambda: hybrid(60, "loss"), r"hybrid: argument 1 must be a Trigger, got 'loss'"),
    (lambda: any_of(every_steps(1), 5), r"any_of: argument 1 must be a Trigger, got 5"),
    (lambda: any_of(on_metric("a"), on_metric("b")), r"at most one on_metric"),
    (lambda: any_of(_SHARED, hybrid(60, _SHARED)), r"appears twice"),
    (lambda: any_of(every_seconds(1, clock=FakeClock()), every_seconds(2, clock=time.time)), r"different clocks"),
    (lambda: hybrid(every_seconds(1, clock=FakeClock()), every_steps(1), clock=time.time), r"different clocks"),
    *[(lambda step=step: every_steps(1).decide(step), rf"step must be a non-negative integer, got {step!r}")
      for step in (-1, 1.0, True, "3")],
    (lambda: on_metric("loss").decide(1, [("loss", 1.0)]), r"metrics must be a mapping"),
])
def test_bad_arguments_name_the_argument_and_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_describe():
    assert repr(every_steps(100)) == "every_steps(100)"
    assert every_seconds(0.5).describe() == "every_seconds(0.5)"
    assert repr(on_metric("acc", "max", 0.01)) == "on_metric('acc', max, min_delta=0.01)"
    assert (repr(any_of(every_steps(100), hybrid(60, on_metric("loss"), min_interval_s=0)))
            == "any_of(every_steps(100), hybrid(every_seconds(60), on_metric('loss', min), min_interval=0s))")


# -- state -------------------------------------------------------------------------------------

def _busy_triggers(clock):
    """One of each kind, with state moved on by a couple of saves."""
    made = [every_steps(2), every_seconds(30, clock=clock), on_metric("loss"),
            any_of(every_steps(2), on_metric("loss", "max")),
            hybrid(every_seconds(30, clock=clock), any_of(every_steps(3), on_metric("loss")), min_interval_s=5)]
    for t in made:
        for step, loss in ((2, 1.0), (4, 0.5)):
            clock.now += 40
            t.committed(t.decide(step, {"loss": loss}, force=True))
    return made


def test_state_round_trips_through_json():
    clock, other = FakeClock(), FakeClock(0.0)
    for t, fresh in zip(_busy_triggers(clock), _busy_triggers(other)):
        state = t.state_dict()
        assert json.loads(json.dumps(state, allow_nan=False)) == state
        fresh.load_state_dict(_json(state))
        assert fresh.state_dict() == state
        clock.now = other.now = clock.now + 1
        assert fresh.decide(6, {"loss": 0.4}) == t.decide(6, {"loss": 0.4})


def test_record_is_json_and_holds_the_state_after_the_save():
    clock = FakeClock()
    t = hybrid(every_seconds(30, clock=clock), on_metric("loss"), min_interval_s=5)
    d = t.decide(3, {"loss": math.nan}, force=True)
    record = t.record(d)
    assert _json(record) == record and record["metric"] is None
    assert t.state_dict()["last_saved_step"] is None      # record() changes nothing
    t.committed(d)
    assert record == {"trigger": repr(t), "reasons": ["forced"], "best": False, "metric": None, "step": 3,
                      "time": 1000.0, "state": t.state_dict()}


def test_load_state_dict_refuses_other_kinds_and_malformed_states():
    steps, seconds, metric, combined, mixed = _busy_triggers(FakeClock())
    deep = _json(mixed.state_dict())
    deep["time"]["last_saved_time"] = 1.0                 # valid, and loaded before the bad part
    deep["event"]["children"][1]["best"] = "low"
    cases = [
        (steps, seconds.state_dict(), r"every_steps: the state is from a 'every_seconds' trigger"),
        (steps, [1, 2], r"must be a dict"),
        (steps, {"kind": "every_steps"}, r"missing keys \['last_saved_step'\]"),
        (steps, {**steps.state_dict(), "n": 2}, r"unexpected keys \['n'\]"),
        (steps, {**steps.state_dict(), "last_saved_step": "4"}, r"'last_saved_step' must be"),
        (seconds, {**seconds.state_dict(), "started_at": None}, r"'started_at' must be a finite number"),
        (seconds, {**seconds.state_dict(), "last_saved_time": math.inf}, r"'last_saved_time'"),
        (metric, {**metric.state_dict(), "name": "acc"}, r"for metric 'acc'"),
        (metric, {**metric.state_dict(), "mode": "max"}, r"\(max\), not 'loss' \(min\)"),
        (metric, {**metric.state_dict(), "best": True}, r"'best' must be"),
        (combined, {**combined.state_dict(), "children": []}, r"list of 2 states"),
        (mixed, deep, r"hybrid\.event\.children\[1\]: 'best' must be"),
    ]
    for trigger, state, message in cases:
        before = trigger.state_dict()
        with pytest.raises(TriggerStateError, match=message):
            trigger.load_state_dict(state)
        assert trigger.state_dict() == before            # all or nothing
    assert issubclass(TriggerStateError, ValueError)


# -- resume equivalence ------------------------------------------------------------------------

def _builders():
    n, s = st.integers(1, 5), st.integers(1, 40)
    metric = st.builds(lambda mode, delta: (lambda: on_metric("loss", mode, delta)),
                       st.sampled_from(["min", "max"]), st.sampled_from([0.0, 0.1, 0.5]))
    gap = st.sampled_from([0, 5, 15, 60])
    return st.one_of(
        st.builds(lambda n: lambda c: every_steps(n), n),
        st.builds(lambda s: lambda c: every_seconds(s, clock=c), s),
        st.builds(lambda m: lambda c: m(), metric),
        st.builds(lambda n, m: lambda c: any_of(every_steps(n), m()), n, metric),
        st.builds(lambda s, m, g: lambda c: hybrid(s, m(), min_interval_s=g, clock=c), s, metric, gap),
        st.builds(lambda s, n, m, g: lambda c: hybrid(every_seconds(s, clock=c), any_of(every_steps(n), m()),
                                                      min_interval_s=g), s, n, metric, gap),
        st.builds(lambda s, n, m, g: lambda c: any_of(hybrid(s, m(), min_interval_s=g, clock=c), every_steps(n)),
                  s, n, metric, gap),
    )


_EVENT = st.tuples(
    st.integers(1, 3),                                                   # step increment
    st.integers(0, 120).map(lambda quarters: quarters / 4),              # clock advance, seconds
    st.sampled_from([None, None, math.nan] + [i / 10 for i in range(-20, 21)]),   # the metric, if any
    st.sampled_from([False] * 11 + [True]),                              # forced (SIGTERM)
    st.sampled_from([False] * 5 + [True]),                               # the save fails
)


def _norm(d: Decision):
    return (d.save, d.reasons, d.best, repr(d.metric), d.step, d.time, d.held, tuple(map(_norm, d.parts)))


def _play(trigger, clock, events, times, steps, start):
    """Decisions from event `start` on; each save commits unless it fails. Also every checkpoint
    written: (index of its event, the state its record holds)."""
    decisions, checkpoints = [], []
    for i in range(start, len(events)):
        _, _, loss, force, fails = events[i]
        clock.now = times[i]
        d = trigger.decide(steps[i], None if loss is None else {"loss": loss}, force=force)
        decisions.append(_norm(d))
        if d.save and not fails:
            record = _json(trigger.record(d))
            trigger.committed(d)
            assert record["state"] == trigger.state_dict()
            checkpoints.append((i, record["state"]))
    return decisions, checkpoints


@settings(max_examples=200, deadline=None)
@given(build=_builders(), events=st.lists(_EVENT, min_size=8, max_size=25), data=st.data())
def test_a_resumed_run_decides_as_the_uninterrupted_one(build, events, data):
    steps, times, step, now = [], [], -1, 1000.0
    for dstep, dt, *_ in events:
        step, now = step + dstep, now + dt
        steps.append(step)
        times.append(now)
    clock = FakeClock(1000.0)
    trigger = build(clock)
    initial = _json(trigger.state_dict())                    # a checkpoint before the first step
    decisions, checkpoints = _play(trigger, clock, events, times, steps, 0)
    cut, state = data.draw(st.sampled_from([(-1, initial)] + checkpoints), label="resume from")
    later = FakeClock(5.0)                                   # another process: its clock starts elsewhere
    resumed = build(later)
    resumed.load_state_dict(state)
    again, _ = _play(resumed, later, events, times, steps, cut + 1)
    assert again == decisions[cut + 1:]
    assert resumed.state_dict() == trigger.state_dict()
