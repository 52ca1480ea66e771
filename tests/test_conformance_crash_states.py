"""Crash states rebuilt offline: parsing a recording, replaying it, judging a resumed probe."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.checks.states import judge_state, resumed_past
from conformance.model.process import ProcessResult, RunSpec
from conformance.offline.crash_states import CrashState, Replayer, build_state, crash_states, probe_specs
from conformance.trace import recording, strace
from conformance.trace.recording import UnreplayableTrace

ROOT = Path("/run/ck")
LOG = Path("/run/loss.jsonl")
LOG_WRITE = '1 write(5</run/loss.jsonl>, "{\\"step\\": 1}\\n", 13) = 13'

RECORDING = "\n".join([
    '1 mkdir("/run/ck/step-3", 0777) = 0',
    '1 openat(AT_FDCWD</run>, "/run/ck/step-3/.a.tmp", O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC, 0644) = 4</run/ck/step-3/.a.tmp>',
    '1 write(4</run/ck/step-3/.a.tmp>, "PK\\x03\\x04\\n\\"q", 7) = 7',
    '1 lseek(4</run/ck/step-3/.a.tmp>, 1, SEEK_SET) = 1',
    '1 write(4</run/ck/step-3/.a.tmp>, "Z", 1) = 1',
    '1 pwrite64(4</run/ck/step-3/.a.tmp>, "YY", 2, 5) = 2',
    '1 writev(4</run/ck/step-3/.a.tmp>, [{iov_base="ab", iov_len=2}, {iov_base="cd", iov_len=2}], 2) = 3',
    '1 fsync(4</run/ck/step-3/.a.tmp>) = 0',
    '1 mkdir("/run/ck/step-3", 0777) = -1 EEXIST (File exists)',
    '1 rename("/run/ck/step-3/.a.tmp", "/run/ck/step-3/a") = 0',
    '1 openat(AT_FDCWD</run>, "/run/ck/step-3", O_RDONLY|O_DIRECTORY) = 6</run/ck/step-3>',
    LOG_WRITE,
    '2 openat(AT_FDCWD</run>, "/run/ck/x", O_WRONLY|O_CREAT|O_TRUNC, 0644 <unfinished ...>',
    '1 write(9</dev/null>, "noise", 5) = 5',
    '2 <... openat resumed>) = 7</run/ck/x>',
    '2 write(7</run/ck/x>, "0123456789", 10) = 4',
    '2 ftruncate(7</run/ck/x>, 2) = 0',
    '1 rename("/run/ck/step-3", "/run/ck/step-03") = 0',
    '1 unlinkat(AT_FDCWD</run>, "/run/ck/x", 0) = 0',
])


def parse_recording(text: str, root: Path = ROOT, log: Path = LOG) -> recording.RecordedRun:
    return recording.build(strace.parse(text), RunSpec(3, 1, 0), ProcessResult(0, {}, ""), root, log)


def test_parse_recording_keeps_mutations_with_their_data_and_step():
    ops = parse_recording(RECORDING).ops
    assert [(o.kind, o.path) for o in ops] == [
        ("mkdir", "step-3"), ("create", "step-3/.a.tmp"), ("write", "step-3/.a.tmp"), ("seek", "step-3/.a.tmp"),
        ("write", "step-3/.a.tmp"), ("write", "step-3/.a.tmp"), ("write", "step-3/.a.tmp"), ("fsync", "step-3/.a.tmp"),
        ("rename", "step-3/.a.tmp"), ("create", "x"), ("write", "x"), ("truncate", "x"), ("rename", "step-3"),
        ("unlink", "x")]
    assert ops[2].data == b'PK\x03\x04\n"q'
    assert ops[5].offset == 5 and ops[6].data == b"abc"          # writev: only the bytes written
    assert ops[10].data == b"0123"                               # a short write: what was written
    assert [o.after_step for o in ops] == [0] * 9 + [1] * 5       # the loss-log write moved the step on


def test_replayer_applies_prefixes_exactly(tmp_path):
    run = parse_recording(RECORDING)
    r = Replayer()
    for op in run.ops:
        r.apply(op)
    assert dict(r.files) == {"step-03/a": bytearray(b"PZabcYY")}   # writev continues at the seek position
    assert r.dirs == {".", "step-03"}
    r.materialize(tmp_path / "out")
    assert (tmp_path / "out/step-03/a").read_bytes() == b"PZabcYY"
    state = crash_states(run)[3]   # before the first write: the second state of op 2 is its torn variant
    assert (state.before, state.torn) == (2, True)
    build_state(run, state, tmp_path / "torn")
    assert (tmp_path / "torn/step-3/.a.tmp").read_bytes() == b"PK\x03"


def test_crash_states_know_what_was_committed():
    run = parse_recording(RECORDING + "\n" + LOG_WRITE.replace("1}", "2}"))
    states = crash_states(run)
    first = states[0]
    assert (first.newest_committed, first.in_progress) == (0, None)
    inside = [s for s in states if s.in_progress == 1]
    assert inside and all(s.newest_committed == 0 for s in inside)
    assert sum(s.torn for s in states) == 4   # every write of more than one byte


@pytest.mark.parametrize("line, problem", [
    ('1 write(4</run/ck/a>, "abc"..., 9) = 9', "larger than"),
    ('1 renameat(5<socket:[7]>, "a", AT_FDCWD</run>, "/run/ck/b") = 0', "not a regular file"),
])
def test_unreplayable_recordings_say_why(tmp_path, line, problem):
    run = parse_recording(line)
    with pytest.raises(UnreplayableTrace, match=problem):
        for state in crash_states(run):
            build_state(run, state, tmp_path / "s")


def _result(rc: int, losses: dict[int, float]) -> ProcessResult:
    return ProcessResult(rc, losses, "")


def test_probes_and_judgement():
    spec = RunSpec(14, 3, 0)
    state = CrashState(10, False, "kill before op #10", newest_committed=3, in_progress=6)
    assert [p.total_steps for p in probe_specs(spec, state)] == [4, 7]
    complete = CrashState(10, False, "kill before op #10", newest_committed=3, in_progress=6, save_complete=True)
    assert [p.total_steps for p in probe_specs(spec, complete)] == [7]
    base = {4: 1.0, 7: 2.0}
    assert judge_state(state, _result(0, {4: 1.0}), base, RunSpec(4, 3, 0), 1e-4) is None
    assert judge_state(state, _result(0, {7: 2.0}), base, RunSpec(7, 3, 0), 1e-4) is None
    assert "from scratch" in judge_state(state, _result(0, {1: 0.5, 2: 0.5, 3: 0.5, 4: 1.0}), base, RunSpec(4, 3, 0), 1e-4)
    assert "exited 1" in judge_state(state, _result(1, {}), base, RunSpec(4, 3, 0), 1e-4)
    assert "loaded incomplete state" in judge_state(state, _result(0, {4: 1.5}), base, RunSpec(4, 3, 0), 1e-4)
    assert resumed_past(_result(0, {})) and not resumed_past(_result(3, {}))
    assert "without training" in judge_state(state, _result(0, {}), base, RunSpec(7, 3, 0), 1e-4)
    # The run's final save, its files all in place (a manifest's directory fsync still to come):
    # nothing is left to train, and that is right.
    final = CrashState(10, False, "kill before op #10", newest_committed=12, in_progress=14, save_complete=True)
    assert judge_state(final, _result(0, {}), base, RunSpec(14, 3, 0), 1e-4) is None
    unfinished = dataclasses.replace(final, save_complete=False)
    assert "without training" in judge_state(unfinished, _result(0, {}), base, RunSpec(14, 3, 0), 1e-4)


@pytest.mark.needs_strace
def test_recording_a_real_program_replays_to_its_final_state(tmp_path):
    """Record a program that writes, renames and deletes under a directory; the replayed end state
    equals what it left on disk, byte for byte."""
    root, log = tmp_path / "ck", tmp_path / "log"
    root.mkdir()
    program = (
        "import os, sys\n"
        "root = sys.argv[1]\n"
        "os.makedirs(os.path.join(root, 'd'))\n"
        "with open(os.path.join(root, 'd', '.t'), 'wb') as f:\n"
        "    f.write(bytes(range(256)) * 64); f.flush(); os.fsync(f.fileno())\n"
        "os.replace(os.path.join(root, 'd', '.t'), os.path.join(root, 'd', 'f'))\n"
        "with open(os.path.join(root, 'g'), 'w') as f: f.write('x' * 10)\n"
        "os.unlink(os.path.join(root, 'g'))\n"
        "os.rename(os.path.join(root, 'd'), os.path.join(root, 'e'))\n")
    trace = tmp_path / "t.strace"
    subprocess.run(strace.record_argv(trace, data=True) + [sys.executable, "-c", program, str(root)], check=True,
                   env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    ops = parse_recording(trace.read_text(), root, log).ops
    assert {o.kind for o in ops} >= {"mkdir", "create", "write", "fsync", "rename", "unlink"}
    final = Replayer()
    for op in ops:
        final.apply(op)
    final.materialize(tmp_path / "replayed")
    assert (tmp_path / "replayed/e/f").read_bytes() == (root / "e/f").read_bytes()
    assert sorted(p.relative_to(tmp_path / "replayed").as_posix() for p in (tmp_path / "replayed").rglob("*")) == \
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_a_file_written_elsewhere_and_renamed_in_keeps_its_bytes(tmp_path):
    """Lightning (through fsspec) writes its checkpoint to a temp file in the system temp directory
    and renames it into the checkpoint directory: the rename is a crash point, the temp file is not."""
    text = "\n".join([
        '1 openat(AT_FDCWD</run>, "/tmp/tmpab12_xyz", O_RDWR|O_CREAT|O_EXCL, 0600) = 4</tmp/tmpab12_xyz>',
        '1 write(4</tmp/tmpab12_xyz>, "ckpt-bytes", 10) = 10',
        '1 write(8</tmp/unrelated.log>, "noise", 5) = 5',
        '1 rename("/tmp/tmpab12_xyz", "/run/ck/last.ckpt") = 0',
        '1 rename("/run/ck/old.ckpt", "/tmp/trash") = 0',
    ])
    run = parse_recording(text)
    assert [(o.kind, o.inside) for o in run.ops] == [("create", False), ("write", False), ("rename", True),
                                                      ("rename", True)]
    states = crash_states(run)
    assert [s.before for s in states] == [2, 3]          # crash points only under the checkpoint dir
    build_state(run, states[1], tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["last.ckpt"]
    assert (tmp_path / "s/last.ckpt").read_bytes() == b"ckpt-bytes"


def test_states_that_leave_the_same_directory_are_decided_once(tmp_path):
    """An fsync changes nothing a kill leaves: the states before and after it are one directory,
    judged alike, and decided once; every state that changes a byte is its own."""
    from conformance.offline.crash_states import distinct
    run = parse_recording(RECORDING)
    states = crash_states(run)
    by_label = {s.label: s for s in states}
    fsync = next(o.index for o in run.ops if o.kind == "fsync")
    assert by_label[str(fsync)].content == by_label[str(fsync + 1)].content        # around the fsync
    assert by_label[str(fsync)].verdict_key == by_label[str(fsync + 1)].verdict_key
    writes = [o.index for o in run.ops if o.kind == "write" and o.path == "step-3/.a.tmp"]
    contents = [by_label[str(i)].content for i in writes] + [by_label[f"{writes[0]}t"].content]
    assert len(set(contents)) == len(contents)
    groups = distinct(states)
    assert sum(1 + len(alike) for alike in groups.values()) == len(states) and len(groups) < len(states)
    for first, alike in groups.items():       # the same key: the same directory, byte for byte
        for other in alike:
            build_state(run, first, tmp_path / "a")
            build_state(run, other, tmp_path / "b")
            assert _tree(tmp_path / "a") == _tree(tmp_path / "b"), (first.label, other.label)


def _tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def test_power_cuts_that_leave_the_same_directory_share_a_key(tmp_path):
    """Under the `data` model the writes before an fsync leave nothing durable: the cuts before
    each of them are one directory (decided once by power_loss); the fsync makes a new one."""
    from conformance.offline import powerloss
    run = parse_recording(RECORDING)
    cuts = dict(powerloss.cuts(run, "data"))
    writes = [o.index for o in run.ops if o.kind == "write" and o.path == "step-3/.a.tmp"]
    fsync = next(o.index for o in run.ops if o.kind == "fsync")
    keys = {i: cut.view().key for i, cut in cuts.items()}
    assert len({keys[i] for i in writes}) == 1
    assert keys[fsync + 1] != keys[writes[0]]      # the fsynced bytes survive
    for i, cut in cuts.items():
        for j, other in cuts.items():
            if keys[i] == keys[j]:
                cut.materialize(tmp_path / "a")
                other.materialize(tmp_path / "b")
                assert _tree(tmp_path / "a") == _tree(tmp_path / "b"), (i, j)


def test_failing_states_keep_their_directories_and_passing_ones_are_removed(tmp_path):
    """Crash states and power-loss states share one pool (checks.states.decide_states): with the
    scratch directory elsewhere (a tmpfs), a failing state's directory is moved next to the
    session's work files, even when deciding raises meanwhile."""
    import dataclasses as dc
    import tempfile
    from types import SimpleNamespace

    from conformance.checks.states import decide_states

    @dc.dataclass(frozen=True)
    class State:
        label: str

    scratch, work = tmp_path / "scratch", tmp_path / "work"
    scratch.mkdir()
    work.mkdir()
    session = SimpleNamespace(scratch=scratch, workdir=work,
                              case_dir=lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch)))

    def decide(state, d, _observe):
        (d / "left.txt").write_text(state.label)
        return (f"state {state.label} is bad" if state.label in ("3", "5") else None), None, None

    failures = decide_states(session, "power-data", "power", {State(str(n)): [] for n in range(8)}, decide)
    assert sorted(s.label for s, _, _ in failures) == ["3", "5"]
    kept = sorted(p.name.split("-")[1] for p in work.iterdir())
    assert kept == ["3", "5"] and not list(scratch.iterdir())

    def broken(state, d, _observe):
        (d / "left.txt").write_text(state.label)
        raise RuntimeError("the judge crashed")

    with pytest.raises(RuntimeError):
        decide_states(session, "states", "state", {State("9"): []}, broken)
    assert any(p.name.startswith("state-9-") for p in work.iterdir()) and not list(scratch.iterdir())


class _CountingRunner:
    """Stands in for a runner: counts the resumes it is asked for; a traced one 'opens' the
    checkpoint file, so what it named is under the directory it ran in."""

    limits = None

    def __init__(self):
        self.calls = []

    def run_process(self, adapter, spec, ckpt_dir, loss_log, *, tracing=None, stop=None):
        self.calls.append((spec.total_steps, ckpt_dir, tracing is not None))
        text = f'1 openat(AT_FDCWD</>, "{ckpt_dir}/step-3/a", O_RDONLY) = 3<{ckpt_dir}/step-3/a>\n'
        return ProcessResult(0, {4: 0.5}, f"resumed in {ckpt_dir}", trace_text=text if tracing else "")

    def close(self):
        pass


def test_a_kill_and_a_power_cut_that_leave_the_same_files_share_one_resume(tmp_path):
    """crash_states and power_loss resume in many of the same directories (a cut that lost nothing
    unsynced leaves what a kill leaves): the second asks the session, which runs each (probe,
    directory content) once. The content is read from disk, so how a directory was built does not
    matter; what a kept run named moves with it to the directory that asks."""

    from conformance.checks.session import Session
    from conformance.checks.states import observed_run
    from conformance.model.adapters import TrainerAdapter
    from conformance.offline import powerloss
    from conformance.offline.unseen import DirectoryView

    run = parse_recording(RECORDING)
    kills = {s.before: s for s in crash_states(run) if not s.torn}
    cuts = dict(powerloss.cuts(run, "data"))
    rename = next(o.index for o in run.ops if o.kind == "rename")
    fsync = next(o.index for o in run.ops if o.kind == "fsync")
    build_state(run, kills[rename], tmp_path / "kill" / "ckpt")
    cuts[rename].materialize(tmp_path / "cut" / "ckpt")           # after the fsync: nothing was lost
    cuts[fsync].materialize(tmp_path / "lossy" / "ckpt")          # before it: the written bytes are lost
    build_state(run, kills[fsync], tmp_path / "kill-early" / "ckpt")
    key = {name: DirectoryView.read(tmp_path / name / "ckpt").key for name in ("kill", "cut", "lossy", "kill-early")}
    assert key["kill"] == key["cut"] and key["lossy"] != key["kill-early"]

    runner = _CountingRunner()
    session = Session(TrainerAdapter(name="stub", argv=("x",)), tmp_path / "work", runner=runner)
    probe = RunSpec(8, 3, 0)

    def resume(name, spec=probe, observe=False):
        return observed_run(session, spec, tmp_path / name / "ckpt", tmp_path / name / "loss.jsonl", observe)

    first, _ = resume("kill")
    again, _ = resume("cut")
    assert (len(runner.calls), session.resumes_shared) == (1, 1)
    assert again.stderr == first.stderr == f"resumed in {tmp_path / 'kill' / 'ckpt'}"
    resume("lossy")
    resume("cut", spec=probe.but(total_steps=5))                  # another probe is another run
    assert (len(runner.calls), session.resumes_shared) == (3, 1)
    # An unobserved run cannot say what a resume looked at: an observing request runs again,
    # and is then kept for the next one, which sees it under its own directory.
    _, named = resume("cut", observe=True)
    assert runner.calls[-1] == (8, tmp_path / "cut" / "ckpt", True) and len(runner.calls) == 4
    _, named = resume("kill", observe=True)
    assert len(runner.calls) == 4 and session.resumes_shared == 2
    assert f"{tmp_path}/kill/ckpt/step-3/a" in named.paths and not any("/cut/" in p for p in named.paths)
    session.close()
