"""Hypothesis strategies for crash schedules. Every drawn value is data: replays are exact."""
from __future__ import annotations

from hypothesis import strategies as st

from .crash import CrashPoint, Schedule
from .trials import Baseline

CADENCES = (3, 4)   # with the bundled trainer's 5 batches per epoch, both save mid-epoch


def step_points(baseline: Baseline) -> st.SearchStrategy[CrashPoint]:
    last = baseline.spec.total_steps - 1
    return st.integers(1, max(1, last)).map(lambda k: CrashPoint("step", k))


def fs_points(baseline: Baseline) -> st.SearchStrategy[CrashPoint]:
    n = len(baseline.crash_points())
    return st.integers(0, max(0, n - 1)).map(lambda i: CrashPoint("fs", i))


def in_save_points(baseline: Baseline) -> st.SearchStrategy[CrashPoint]:
    """fs points that fall inside a save (after some step was logged), where torn state lives."""
    windows = baseline.save_windows()
    inside = {i for step, idxs in windows.items() if step for i in idxs}
    targetable = baseline.crash_points()
    ordinals = [k for k, i in enumerate(targetable) if i in inside] or list(range(len(targetable)))
    return st.sampled_from(ordinals).map(lambda k: CrashPoint("fs", k))


def later_points() -> st.SearchStrategy[CrashPoint]:
    """Points for a resumed process, whose trace is not known in advance: fs indices wrap."""
    return st.one_of(st.integers(0, 40).map(lambda i: CrashPoint("fs", i)),
                     st.integers(1, 11).map(lambda k: CrashPoint("step", k)))


def schedules(baseline: Baseline, *, max_crashes: int = 2) -> st.SearchStrategy[Schedule]:
    first = st.one_of(fs_points(baseline), step_points(baseline))
    rest = st.lists(later_points(), max_size=max_crashes - 1)
    return st.tuples(first, rest).map(lambda fr: (fr[0], *fr[1]))
