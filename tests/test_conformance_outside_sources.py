"""Files a save copies, links or renames in from outside what the trace wrote (DeepSpeed's
`zero_to_fp32.py`, a tokenizer, a config): their bytes come from the source, recorded (size,
mtime, sha256) when the run is recorded (trace/recording.py); a state that cannot be rebuilt is
left out and counted, and a check none of whose states can be is not judged, never failed."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.model import evidence
from conformance.model.process import ProcessResult, RunSpec
from conformance.offline import powerloss
from conformance.offline.crash_states import Replayer, build_state, crash_states
from conformance.trace import recording, strace
from conformance.trace.recording import UnreplayableTrace

STATIC = b"#!/usr/bin/env python\n# zero_to_fp32.py: recover fp32 weights from a ZeRO checkpoint\n" * 3


def _record(tmp_path: Path, lines: list[str]) -> recording.RecordedRun:
    root = tmp_path / "ck"
    text = "\n".join(line.format(root=root, src=tmp_path / "site-packages" / "zero_to_fp32.py", n=len(STATIC),
                                 card=tmp_path / "card.md") for line in lines)
    return recording.build(strace.parse(text), RunSpec(3, 1, 0), ProcessResult(0, {}, ""), root, tmp_path / "loss.jsonl")


def _static(tmp_path: Path) -> Path:
    src = tmp_path / "site-packages" / "zero_to_fp32.py"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(STATIC)
    return src


# A save as DeepSpeed's: the model, then shutil.copyfile of a static file (two sendfile calls, the
# second at the end of the file), then the `latest` pointer; then retention deletes the copy.
DEEPSPEED_SAVE = [
    '1 mkdir("{root}/global_step3", 0777) = 0',
    '1 openat(AT_FDCWD</>, "{root}/global_step3/model.pt", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 4<{root}/global_step3/model.pt>',
    '1 write(4<{root}/global_step3/model.pt>, "weights", 7) = 7',
    '1 openat(AT_FDCWD</>, "{root}/zero_to_fp32.py", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 5<{root}/zero_to_fp32.py>',
    '1 sendfile(5<{root}/zero_to_fp32.py>, 3<{src}>, [0] => [{n}], 8388608) = {n}',
    '1 sendfile(5<{root}/zero_to_fp32.py>, 3<{src}>, [{n}], 8388608) = 0',
    '1 openat(AT_FDCWD</>, "{root}/latest", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 6<{root}/latest>',
    '1 write(6<{root}/latest>, "global_step3", 12) = 12',
    '1 unlink("{root}/zero_to_fp32.py") = 0',
    '1 openat(AT_FDCWD</>, "{root}/done", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 7<{root}/done>',
]


def test_a_copy_from_outside_the_trace_takes_the_sources_recorded_bytes(tmp_path):
    _static(tmp_path)
    run = _record(tmp_path, DEEPSPEED_SAVE)
    copy = next(op for op in run.ops if op.kind == "copy")
    assert copy.source is not None and copy.source.size == len(STATIC) and not copy.source.problem
    assert run.unreplayable is None
    states = crash_states(run)
    assert not any(s.left_out for s in states)
    pointer = next(s for s in states if s.description.endswith("write 12 bytes to latest)") and not s.torn)
    build_state(run, pointer, tmp_path / "state")
    assert (tmp_path / "state" / "zero_to_fp32.py").read_bytes() == STATIC
    assert (tmp_path / "state" / "global_step3" / "model.pt").read_bytes() == b"weights"
    cut = dict(powerloss.cuts(run, "data"))[pointer.before]   # never fsynced: a power cut leaves it empty
    assert cut.files["zero_to_fp32.py"] == b"" and not cut.left_out


def test_a_source_changed_since_the_run_was_recorded_leaves_its_states_out(tmp_path):
    src = _static(tmp_path)
    run = _record(tmp_path, DEEPSPEED_SAVE)
    synced = _record(tmp_path, [*DEEPSPEED_SAVE[:6], "1 fsync(5<{root}/zero_to_fp32.py>) = 0", *DEEPSPEED_SAVE[6:]])
    src.write_bytes(STATIC.replace(b"fp32", b"fp16"))   # same size: only its sha256 (and mtime) tell
    os.utime(src, ns=(run.ops[4].source.mtime_ns, run.ops[4].source.mtime_ns))   # even the same mtime
    states = crash_states(run)
    copied = [s for s in states if s.before > 4 and s.before <= 8]   # the copy shows until it is deleted
    assert copied and all("changed since the run was recorded" in s.left_out and "sha256" in s.left_out
                          for s in copied)
    assert not any(s.left_out for s in states if s.before <= 4 or s.before > 8)
    with pytest.raises(UnreplayableTrace, match="zero_to_fp32.py"):
        build_state(run, copied[0], tmp_path / "state")
    build_state(run, states[-1], tmp_path / "after")   # deleted again: rebuildable
    assert sorted(p.name for p in (tmp_path / "after").iterdir()) == ["global_step3", "latest"]
    # A power cut loses the copy's bytes (never fsynced): no power-loss state needs them. Once
    # fsynced, every cut that keeps the file needs them.
    assert not any(c.left_out for _, c in powerloss.cuts(run, "data"))
    left = {i for i, c in powerloss.cuts(synced, "data") if c.left_out}
    assert left == {7, 8, 9} and "sha256" in dict(powerloss.cuts(synced, "data"))[7].left_out


def test_a_source_that_changes_after_its_states_were_listed_is_left_out_when_built(tmp_path):
    src = _static(tmp_path)
    run = _record(tmp_path, DEEPSPEED_SAVE)
    after_copy = next(s for s in crash_states(run) if s.before == 6)
    assert not after_copy.left_out
    time.sleep(0.01)
    src.write_bytes(STATIC + b"# patched\n")
    with pytest.raises(UnreplayableTrace, match="changed since the run was recorded"):
        build_state(run, after_copy, tmp_path / "state")


def test_links_and_renames_from_outside_the_trace_bring_their_bytes(tmp_path):
    """A hard link of a file the trace never wrote (a config shipped with the code), and a
    rename of one (a tokenizer staged by another process): both take their bytes from disk, the
    renamed one from where the run left it."""
    (tmp_path / "card.md").write_bytes(b"# card\n")
    staged = tmp_path / "staged.json"
    staged.write_bytes(b'{"vocab": 3}')
    lines = [
        '1 mkdir("{root}/step-3", 0777) = 0',
        '1 link("{card}", "{root}/step-3/card.md") = 0',
        f'1 rename("{staged}", "{{root}}/step-3/tokenizer.json") = 0',
        '1 openat(AT_FDCWD</>, "{root}/step-3/done", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 7<{root}/step-3/done>',
    ]
    rename = next(op for op in _record(tmp_path, lines).ops if op.kind == "rename")
    assert rename.source.at == str(tmp_path / "ck" / "step-3" / "tokenizer.json")
    assert "could not be read" in rename.source.problem   # not where the run left it: nowhere to read it
    (tmp_path / "ck" / "step-3").mkdir(parents=True)
    os.rename(staged, tmp_path / "ck" / "step-3" / "tokenizer.json")   # as the run left it
    run = _record(tmp_path, lines)
    replayer = Replayer()
    for op in run.ops:
        replayer.apply(op)
    assert replayer.files["step-3/card.md"] == b"# card\n"
    assert replayer.files["step-3/tokenizer.json"] == b'{"vocab": 3}' and not replayer.problem()
    model = powerloss.Model()
    for op in run.ops:
        model.apply(op)
    cut = model.cut("data", len(run.ops))   # on disk before the run: durable without an fsync
    assert cut.files["step-3/card.md"] == b"# card\n" and cut.files["step-3/tokenizer.json"] == b'{"vocab": 3}'


def test_a_source_too_large_to_hold_is_recorded_as_such_without_reading_it(tmp_path):
    big = tmp_path / "base_model.safetensors"
    with open(big, "wb") as f:
        f.truncate(strace.MAX_DATA_BYTES + 1)   # sparse: nothing is written
    found = recording.record_source(str(big), str(big))
    assert "larger than" in found.problem and not found.sha256
    with pytest.raises(UnreplayableTrace, match="larger than"):
        found.read()


def test_a_source_the_trace_wrote_takes_its_bytes_from_the_trace(tmp_path):
    """A file the trainer wrote outside the checkpoint directory (through a temp name) and then
    linked and copied in: the trace's bytes, not the disk's (which may have changed since)."""
    run = _record(tmp_path, [
        '1 openat(AT_FDCWD</>, "{card}.tmp", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 3<{card}.tmp>',
        '1 write(3<{card}.tmp>, "# card", 6) = 6',
        '1 rename("{card}.tmp", "{card}") = 0',
        '1 link("{card}", "{root}/card.md") = 0',
        '1 openat(AT_FDCWD</>, "{card}", O_RDONLY) = 4<{card}>',
        '1 openat(AT_FDCWD</>, "{root}/copy.md", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 5<{root}/copy.md>',
        '1 sendfile(5<{root}/copy.md>, 4<{card}>, [0] => [6], 8388608) = 6',
    ])
    assert not any(op.source for op in run.ops)
    replayer = Replayer()
    for op in run.ops:
        replayer.apply(op)
    assert replayer.files["card.md"] == replayer.files["copy.md"] == b"# card" and not replayer.problem()


def test_a_storage_error_the_trainer_went_on_after_rebuilds_a_copy_from_outside(tmp_path):
    """io_error: a trainer that goes on after its failed save is started again on the directory it
    left before its next save, rebuilt from the faulted run's recording (faults/injection.py): a
    static file copied in is rebuilt from its source; once that source changed, the case is left
    out as an undelivered draw (StateNotRebuilt), never an error of the trainer's."""
    from conformance.faults.delivery import CrashPointMissing
    from conformance.faults.injection import StateNotRebuilt, rebuild_before_next_save
    src = _static(tmp_path)
    run = _record(tmp_path, DEEPSPEED_SAVE[:8])
    rebuild_before_next_save(run, 0, tmp_path / "went-on")
    assert (tmp_path / "went-on" / "zero_to_fp32.py").read_bytes() == STATIC
    assert (tmp_path / "went-on" / "global_step3" / "model.pt").read_bytes() == b"weights"
    src.write_bytes(b"another version")
    with pytest.raises(StateNotRebuilt, match="cannot be rebuilt.*changed since the run was recorded") as caught:
        rebuild_before_next_save(run, 0, tmp_path / "went-on")
    assert isinstance(caught.value, CrashPointMissing)   # the suite draws another case and counts this one


def _fake_session(tmp_path: Path, run: recording.RecordedRun):
    return SimpleNamespace(baseline=lambda spec: run, resumes_shared=0, scratch=tmp_path, workdir=tmp_path,
                           case_dir=lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_path)))


def _decide(check: str, session, run: recording.RecordedRun) -> None:
    from conformance.checks.power import power_loss
    from conformance.checks.states import crash_states_check
    if check == "crash_states":
        crash_states_check(session, check, run.spec)
    else:
        power_loss(session, "power_loss[data]", run.spec, "data")


@pytest.mark.parametrize("check", ["crash_states", "power_loss"])
def test_a_check_whose_run_cannot_be_replayed_is_not_judged(tmp_path, check):
    """A shared writable mapping of a checkpoint file: its writes are not syscalls, so no state of
    the run can be rebuilt. The check says so and decides nothing; it neither passes nor fails."""
    from conformance.checks.failures import CheckNotApplicable
    run = _record(tmp_path, [
        '1 openat(AT_FDCWD</>, "{root}/big", O_RDWR|O_CREAT|O_TRUNC, 0644) = 3<{root}/big>',
        '1 mmap(NULL, 4096, PROT_READ|PROT_WRITE, MAP_SHARED, 3<{root}/big>, 0) = 0x7f0000000000',
        '1 fsync(3<{root}/big>) = 0',
    ])
    evidence.take()
    with pytest.raises(CheckNotApplicable, match=r"^not judged: the recorded run cannot be replayed offline \(a shared "
                                                 r"writable mmap of big.*says nothing of the trainer"):
        _decide(check, _fake_session(tmp_path, run), run)
    record, = [e for e in evidence.take() if isinstance(e, (evidence.CrashStates, evidence.PowerLoss))]
    assert record.left_out == record.states == 2 and record.failed == 0 and "2 left out" in record.summary()


@pytest.mark.parametrize("check", ["crash_states", "power_loss"])
def test_a_check_whose_states_were_all_left_out_is_not_judged(tmp_path, check, monkeypatch):
    """Every state's directory fails to build when it is decided (its source changed since): none
    is decided, and the check says so."""
    from conformance.checks import power, states
    from conformance.checks.failures import CheckNotApplicable
    _static(tmp_path)
    run = _record(tmp_path, DEEPSPEED_SAVE)

    def unbuildable(*args, **kw):
        raise UnreplayableTrace("`zero_to_fp32.py` changed since the run was recorded")
    monkeypatch.setattr(states if check == "crash_states" else power,
                        "decide_state" if check == "crash_states" else "decide_power_state", unbuildable)
    evidence.take()
    with pytest.raises(CheckNotApplicable, match=r"^not judged: none of the \d+ (crash|power-loss) states could be "
                                                 r"rebuilt offline.*changed since.*says nothing of the trainer"):
        _decide(check, _fake_session(tmp_path, run), run)
    record, = [e for e in evidence.take() if isinstance(e, (evidence.CrashStates, evidence.PowerLoss))]
    assert record.left_out == record.states > 0 and record.failed == 0 and record.resumed == 0


def test_a_state_that_cannot_be_built_while_deciding_is_left_out_not_failed(tmp_path):
    from conformance.checks.states import decide_states

    class State(SimpleNamespace):
        __hash__ = object.__hash__
        view = None

    states = [State(label=str(n), verdict_key=(n,)) for n in range(4)]
    twin = State(label="4", verdict_key=(2,))
    same = {s: [] for s in states}
    same[states[2]] = [twin]

    def decide(state, directory, observe):
        if state.label == "2":
            raise UnreplayableTrace("`zero_to_fp32.py` changed since the run was recorded")
        return None, None, None

    left: list = []
    assert decide_states(_fake_session(tmp_path, None), "states", "state", same, decide, left) == []
    assert [(s.label, why) for s, why in left] == [("2", "`zero_to_fp32.py` changed since the run was recorded"),
                                                   ("4", "`zero_to_fp32.py` changed since the run was recorded")]
    assert sorted(s.label for s in same) == ["0", "1", "3"]


def test_compound_faults_left_out_everywhere_is_not_judged(tmp_path):
    from conformance.checks.compound import draw_state
    from conformance.checks.failures import CheckNotApplicable
    run = recording.RecordedRun(RunSpec(3, 1, 0), ProcessResult(0, {}, ""), tmp_path, (), {}, frozenset(),
                                unreplayable="a shared writable mmap of step-3/model.pt (its writes are not syscalls)")
    with pytest.raises(CheckNotApplicable, match="^not judged: .*mmap"):
        draw_state(run, "kill_then_damage")


CHECKS = ("crash_states", "power_loss[data]", "power_loss[strict]", "compound_faults[kill_then_damage]",
          "compound_faults[power_then_damage]", "io_error[enospc]", "io_error[eio]")


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_trainer_that_copies_a_static_file_into_every_save_passes_the_offline_checks(run_suite):
    """The DeepSpeed case: every save copies a static file in with sendfile, and hard-links another.
    Each offline check rebuilds its states, runs the trainer, and passes."""
    verdicts, out = run_suite("--adapter=resume_conformance.fixtures.hostile.copies_static_file:ADAPTER",
                              "-k", "crash_states or power_loss or compound_faults or io_error",
                              "--hypothesis-profile=conformance-quick")
    got = {name.removeprefix("test_"): outcome for name, (outcome, _) in verdicts.items()}
    assert got == dict.fromkeys(CHECKS, "passed"), "\n\n".join(
        f"{name}: {message[:2000]}" for name, (outcome, message) in verdicts.items() if outcome != "passed") + out[-2000:]
