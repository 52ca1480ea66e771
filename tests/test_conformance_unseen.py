"""Offline states that differ only in files a resume never looked at share its verdict
(offline/unseen.py): what a resume looked at is read from its own trace (strace.named), and a
state is merged into a decided one only if every file that resume could have learned anything of
holds the same bytes, under the same names."""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from types import SimpleNamespace

from conformance.checks.states import decide_states
from conformance.offline.unseen import DirectoryView
from conformance.trace import strace

TRACE = """\
100 openat(AT_FDCWD</w>, "ckpt/step-3/model.pt", O_RDONLY|O_CLOEXEC) = 3</w/ckpt/step-3/model.pt>
100 read(3</w/ckpt/step-3/model.pt>, ""..., 4096) = 4096
100 close(3</w/ckpt/step-3/model.pt>) = 0
101 newfstatat(AT_FDCWD</w>, "/w/ckpt/step-6/model.pt", 0x7ffc, 0) = 0
101 stat("rel.bin", 0x7ffc) = 0
101 openat(AT_FDCWD</w>, "ckpt/.staging", O_RDONLY|O_DIRECTORY) = 4</w/ckpt/.staging>
101 unlinkat(4</w/ckpt/.staging>, ".model.pt.tmp-1", 0) = 0
101 getdents64(4</w/ckpt/.staging>, 0x5555 /* 3 entries */, 32768) = 80
"""


def test_named_gives_every_path_a_call_could_learn_from_and_skips_calls_that_only_remove_a_name():
    named = strace.named(TRACE)
    assert {"/w/ckpt/step-3/model.pt", "/w/ckpt/step-6/model.pt", "/w/ckpt/.staging"} <= named.paths
    assert named.names == {"rel.bin"}     # relative, without a directory fd: known by its base name only
    assert not any("tmp-1" in p for p in named.paths | named.names)


def view(**files) -> DirectoryView:
    return DirectoryView.of({k.replace("__", "/"): v for k, v in files.items()}, {".", "step-3"}, {})


def test_a_state_looks_like_a_decided_one_only_where_the_resume_looked():
    decided = view(step_3__model=1, tmp=2)
    seen = decided.seen(strace.Named(frozenset({"/w/ckpt/step_3/model"}), frozenset()), Path("/w/ckpt"))
    assert seen == {"step_3/model"}
    assert view(step_3__model=1, tmp=9).looks_like(decided, seen)           # the unread file differs
    assert not view(step_3__model=7, tmp=2).looks_like(decided, seen)       # the read one differs
    assert not view(step_3__model=1, tmp=2, more=1).looks_like(decided, seen)   # another name


def test_a_path_outside_the_directory_or_without_one_counts_by_its_base_name():
    decided = view(a__model=1, b__model=2, other=3)
    outside = strace.Named(frozenset({"/elsewhere/model"}), frozenset({"other"}))
    assert decided.seen(outside, Path("/w/ckpt")) == {"a/model", "b/model", "other"}


def test_a_symlink_the_resume_went_through_counts_its_target():
    files = DirectoryView.of({"step-3.pt": 1, "step-6.pt": 2}, {"."}, {"latest.pt": "step-6.pt"})
    assert files.seen(strace.Named(frozenset({"/w/ckpt/latest.pt"}), frozenset()), Path("/w/ckpt")) == {"step-6.pt"}
    dirs = DirectoryView.of({"step-3/model": 1, "step-6/model": 2}, {".", "step-3", "step-6"}, {"latest": "step-6"})
    through = dirs.seen(strace.Named(frozenset({"/w/ckpt/latest/model"}), frozenset()), Path("/w/ckpt"))
    assert through == {"step-3/model", "step-6/model"}   # by base name: whichever the link points to


@dataclasses.dataclass(frozen=True)
class State:
    before: int
    content: str
    view: DirectoryView = dataclasses.field(compare=False, repr=False)
    newest_committed: int = 0

    @property
    def label(self) -> str:
        return str(self.before)

    @property
    def verdict_key(self) -> tuple:
        return (self.content, self.newest_committed)


def _session(tmp_path):
    return SimpleNamespace(scratch=tmp_path, workdir=tmp_path,
                           case_dir=lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_path)))


def test_only_states_that_differ_where_a_resume_looked_are_run(tmp_path):
    # States 0-3 write a temp file the resume never reads; state 4 changes the file it reads;
    # state 5 is judged differently (another newest checkpoint).
    states = [State(i, f"c{i}", view(model=1, tmp=i)) for i in range(4)]
    states += [State(4, "c4", view(model=2, tmp=4)), State(5, "c5", view(model=1, tmp=5), newest_committed=3)]
    same = {s: [] for s in states}
    ran = {}

    def decide(state, _directory, observe):
        ran[state.before] = observe
        return ("bad" if state.before == 0 else None), None, frozenset({"model"}) if observe else None

    failures = decide_states(_session(tmp_path), "states", "state", same, decide)
    # Traced only where another state could take the verdict: state 5 is alone in its group, and
    # state 4 is the last of its group left.
    assert ran == {0: True, 5: False, 4: False}
    assert [s.before for s, _, _ in failures] == [0]
    assert [s.before for s in same[states[0]]] == [1, 2, 3]   # they share state 0's failing verdict
    assert len(same) == 3


def test_a_resume_that_read_everything_merges_nothing(tmp_path):
    states = [State(i, f"c{i}", view(model=1, tmp=i)) for i in range(4)]
    same = {s: [] for s in states}
    ran = []

    def decide(state, _directory, _observe):
        ran.append(state.before)
        return None, None, frozenset({"model", "tmp"})

    assert decide_states(_session(tmp_path), "states", "state", same, decide) == []
    assert sorted(ran) == [0, 1, 2, 3] and len(same) == 4


def test_a_probe_whose_trace_is_missing_lends_its_verdict_to_no_other_state():
    """A rank that ended before strace attached left no trace: what it looked at is unknown."""
    from conformance.checks.states import looked_at
    state = State(0, "c0", view(model=1, tmp=0))
    saw = strace.Named(frozenset({"/w/ckpt/model"}), frozenset())
    assert looked_at(state, [saw], Path("/w/ckpt")) == {"model"}
    assert looked_at(state, [saw, None], Path("/w/ckpt")) is None
    assert looked_at(state, [], Path("/w/ckpt")) is None
