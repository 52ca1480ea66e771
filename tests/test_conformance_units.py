"""Meta-tests of the suite's data types, verdict helpers and corruption tools."""
import math
import pickle
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks.failures import fail, loss_mismatches, replay_command
from conformance.faults.corrupt import bitflip, delete, plant_malicious_pickle, truncate
from conformance.model.adapters import AdapterError, command_adapter, python_adapter, resolve
from conformance.model.crash import CrashPoint, format_schedule, parse_schedule
from conformance.model.process import RunSpec, read_losses

ranks = st.none() | st.integers(0, 7)
points = st.builds(CrashPoint, st.sampled_from(["step", "fs"]), st.integers(0, 10_000), ranks) | st.builds(
    CrashPoint, st.just("save"), st.integers(1, 10_000), ranks, op=st.integers(1, 500), thread=st.integers(0, 4))


@given(st.lists(points, max_size=4).map(tuple))
def test_schedule_text_round_trips(schedule):
    assert parse_schedule(format_schedule(schedule)) == schedule


@pytest.mark.parametrize("bad", ["rename:1", "fs:-1", "fs:x", "step", "save:12", "save:0/1", "save:4/0",
                                 "save:4/x1/2", "save:4/t1", "fs:3/1", "step:2/t1/1"])
def test_bad_crash_points_are_refused(bad):
    with pytest.raises(ValueError):
        parse_schedule(bad)


def test_loss_mismatches_flags_nan_missing_and_large_differences():
    base = {1: 1.0, 2: 2.0, 3: 3.0}
    rows = loss_mismatches(base, {1: 1.00001, 2: float("nan"), 3: 3.5, 4: 1.0}, tol=1e-4)
    assert [r[0] for r in rows] == [2, 3, 4]
    assert math.isinf(rows[2][3])
    assert loss_mismatches(base, {1: 1.0, 3: 3.00009}, tol=1e-4) == []


def test_read_losses_ignores_a_torn_last_line(tmp_path):
    log = tmp_path / "loss.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')
    assert read_losses(log) == {1: 0.5, 2: 0.25}


def test_failure_message_has_check_schedule_and_replay_line():
    adapter = resolve(None, None)
    exc = fail("no_lost_work[inside_save]", adapter, RunSpec(12, 3, 0), "resumed from scratch",
               schedule="fs:7", details="  detail line", case={"schedule": "fs:7"})
    text = str(exc)
    assert text.startswith("[no_lost_work[inside_save]] resumed from scratch")
    assert "schedule: fs:7" in text and "detail line" in text
    assert ("replay:   python -m conformance replay --adapter=resume_conformance.fixtures.reference_trainer:ADAPTER "
            "'--check=no_lost_work[inside_save]' --total-steps=12 --save-every=3 --seed=0 --schedule=fs:7") in text


def test_replay_command_quotes_trainer_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    adapter = command_adapter("python train.py --small")
    cmd = replay_command(adapter, "no_torn_state", RunSpec(12, 3, 0), {"schedule": "step:2"})
    assert "'--trainer-cmd=python train.py --small'" in cmd and "--schedule=step:2" in cmd


def test_python_adapter_must_have_run(tmp_path, monkeypatch):
    (tmp_path / "bad_adapter_mod.py").write_text("ADAPTER = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AdapterError, match="neither a TrainerAdapter nor an object with run") as info:
        python_adapter("bad_adapter_mod:ADAPTER")
    assert info.value.fix.startswith("give it a run(ctx) method")
    with pytest.raises(AdapterError, match="package.module:attribute"):
        python_adapter("no_colon")


def _torch_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.full((64,), 0.5), "b": torch.zeros(2)}, path)
    return path


def test_bitflip_hits_tensor_data_and_changes_a_weight_drastically(tmp_path):
    path = _torch_file(tmp_path)
    desc = bitflip(path)
    assert "2 floating-point tensor record(s)" in desc
    w = torch.load(path, weights_only=True)["w"]  # torch.load does not notice
    assert w[0].item() > 1e30 or w[0].item() < 1e-30
    assert torch.all(w[1:] == 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_bitflip_hits_the_top_exponent_bit_of_every_float_width(tmp_path, dtype):
    path = tmp_path / "w.pt"
    ints = torch.arange(5, dtype=torch.int64)
    torch.save({"a": torch.full((8,), 0.5, dtype=dtype), "b": torch.full((3,), 0.5, dtype=dtype), "i": ints}, path)
    bitflip(path)
    loaded = torch.load(path, weights_only=True)
    for key in ("a", "b"):   # the same storage class twice: the second comes from the pickle memo
        first = abs(loaded[key][0].double().item())
        assert first > 1e4 or first < 1e-4, (key, first)
        assert torch.all(loaded[key][1:] == 0.5)
    assert torch.equal(loaded["i"], ints)   # integer records (counters, RNG keys) are left alone


def test_bitflip_in_safetensors_picks_the_largest_float_tensor(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"small": torch.full((2,), 0.5, dtype=torch.float64),
                                 "big": torch.full((16,), 0.5, dtype=torch.float64),
                                 "ids": torch.arange(64)}, str(path))
    bitflip(path)
    loaded = safetensors_torch.load_file(str(path))
    assert loaded["big"][0].item() > 1e300 or loaded["big"][0].item() < 1e-300
    assert torch.all(loaded["small"] == 0.5) and torch.equal(loaded["ids"], torch.arange(64))


def test_bitflip_falls_back_to_the_middle_of_unknown_files(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(100))
    assert "middle" in bitflip(path)
    assert path.read_bytes()[46:54] == bytes([0x40] * 8) and path.read_bytes().count(0) == 92


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("header", [0, 1, 3, 7, 13])
def test_bitflip_in_an_unknown_format_hits_an_exponent_whatever_the_alignment(tmp_path, dtype, header):
    """A raw float array behind a header of any length: one element becomes huge or tiny."""
    values = torch.full((64,), 0.5, dtype=dtype)
    path = tmp_path / "piece"
    path.write_bytes(b"h" * header + values.view(torch.uint8).numpy().tobytes())
    bitflip(path)
    flipped = torch.frombuffer(bytearray(path.read_bytes()[header:]), dtype=dtype).float()
    assert ((flipped.abs() > 1e4) | (flipped.abs() < 1e-4)).any(), flipped


def test_truncate_and_delete(tmp_path):
    path = _torch_file(tmp_path)
    size = path.stat().st_size
    truncate(path)
    assert path.stat().st_size == size // 2
    delete(path)
    assert not path.exists()


def test_malicious_pickle_runs_code_only_without_weights_only(tmp_path):
    path = _torch_file(tmp_path)
    marker = tmp_path / "ran"
    plant_malicious_pickle(path, marker)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not marker.exists()
    with pytest.raises(RuntimeError):  # the code runs before torch notices the bad magic number
        torch.load(path, weights_only=False)  # what a vulnerable trainer does
    assert marker.exists()


def test_replay_command_of_a_multi_rank_trainer_parses_back():
    """The printed replay line is what users paste: every argument it carries must be accepted."""
    import dataclasses
    import shlex

    from conformance.__main__ import build_parser

    adapter = dataclasses.replace(python_adapter("resume_conformance.fixtures.ddp_trainer:ADAPTER"), world_size=2)
    cmd = replay_command(adapter, "no_lost_work[inside_save]", RunSpec(14, 3, 0), {"schedule": "fs:0@r1"})
    args = build_parser().parse_args(shlex.split(cmd)[3:])
    assert (args.world_size, args.check, args.schedule) == ("2", "no_lost_work[inside_save]", "fs:0@r1")


def test_an_adapter_may_ask_for_a_longer_run():
    from conformance.model.adapters import Capability, TrainerAdapter
    from conformance.model.settings import TOTAL_STEPS
    plain = TrainerAdapter(name="t", argv=("x",))
    assert plain.total_steps == TOTAL_STEPS
    longer = TrainerAdapter(name="t", argv=("x",), capabilities=frozenset({"syscall_crash"}), steps=30)
    assert longer.total_steps == 30 and longer.capabilities == {Capability.SYSCALL_CRASH}
    for bad in (3, "30", 13.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 14"):
            TrainerAdapter(name="t", argv=("x",), steps=bad)
    with pytest.raises(ValueError, match=r"\(steps=30 is now the adapter attribute `steps = 30`\)"):
        TrainerAdapter(name="t", argv=("x",), capabilities=frozenset({"steps=30"}))
    with pytest.raises(ValueError, match=r"unknown capabilities \['cold-tier'\]"):
        TrainerAdapter(name="t", argv=("x",), capabilities=frozenset({"cold-tier"}))


def test_a_ready_made_adapter_with_a_bad_capability_is_a_usage_error_not_a_traceback(tmp_path, monkeypatch):
    """A module-level TrainerAdapter is built when its module is imported: what it declares is
    checked there, as an AdapterError (the plugin's usage error, with a fix), like an object adapter's."""
    (tmp_path / "readymade.py").write_text("import sys\nfrom conformance import TrainerAdapter\n"
                                           "ADAPTER = TrainerAdapter(name='t', argv=(sys.executable,), "
                                           "capabilities={'steps=30'})\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterError, match=r"steps=30 is now the adapter attribute") as raised:
        resolve("readymade:ADAPTER", None, rootdir=tmp_path)
    assert "syscall_crash" in raised.value.fix and "Capability." not in raised.value.fix


def test_the_interpreter_is_asked_once_per_process_whether_it_finds_a_trainer_module(monkeypatch):
    """Resolving options twice (configure, then the session) must not start the probe twice: it
    imports the trainer's parent packages (torch, for the bundled ones)."""
    import subprocess

    from conformance.model import importing
    calls = []
    real = subprocess.run
    monkeypatch.setattr(importing.subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    importing._interpreter_finds.cache_clear()
    argv = (sys.executable, "-m", "json.tool")
    assert importing.python_target_problem(argv, sys.executable, ()) is None
    assert importing.python_target_problem(argv, sys.executable, ()) is None
    assert len(calls) == 1


def test_evidence_read_back_from_a_report_equals_what_was_recorded():
    """JSON turns tuples into lists; a record read back (a merged or re-rendered report) is the
    record that was made, every sequence field a tuple again, so it compares and hashes alike."""
    import json

    from conformance.model import evidence
    made = [evidence.Determinism(spec="14 steps", exit_codes=(0, 0), steps=14, max_abs_diff=0.0, tolerance=0.0,
                                 mismatches=evidence.mismatch_rows([(3, 1.0, 1.5, 0.5)]), run_random_names=("tmp",),
                                 digests_left_out=("rng",)),
            evidence.Draws(3, 2, ("never reached", "another"))]
    for record in made:
        again = evidence.Evidence.from_json(json.loads(json.dumps(record.to_json())))
        assert again == record and hash(again) == hash(record)


def test_the_contract_is_typed_and_read_whole_from_the_environment(tmp_path):
    from conformance import RunContext, Trainer
    env = {"CONFORMANCE_CKPT_DIR": str(tmp_path), "CONFORMANCE_TOTAL_STEPS": "14", "CONFORMANCE_SAVE_EVERY": "3",
           "CONFORMANCE_SEED": "0", "CONFORMANCE_LOSS_LOG": str(tmp_path / "l"), "CONFORMANCE_COLD_URL": "file:///c",
           "CONFORMANCE_SHARED_DIR": str(tmp_path / "s"), "CONFORMANCE_RESUME_FROM": "6",
           "CONFORMANCE_HANG_TIMEOUT": "10", "RANK": "1", "WORLD_SIZE": "2"}
    ctx = RunContext.from_env(env)
    assert (ctx.ckpt_dir, ctx.total_steps, ctx.save_every, ctx.seed, ctx.cold_url, ctx.shared_dir, ctx.resume_from,
            ctx.hang_timeout, ctx.rank, ctx.world_size) == (tmp_path, 14, 3, 0, "file:///c", tmp_path / "s", 6, 10.0, 1, 2)
    bare = RunContext.from_env({k: v for k, v in env.items() if k in list(env)[:5]})
    assert (bare.cold_url, bare.shared_dir, bare.resume_from, bare.hang_timeout, bare.rank, bare.world_size) == \
        (None, None, None, None, 0, 1)
    from resume_conformance.fixtures.python_adapter import ADAPTER
    assert isinstance(ADAPTER, Trainer) and not isinstance(object(), Trainer)


def test_the_version_has_one_source():
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from resume_conformance import reference

    import conformance
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert conformance.__version__ == reference.__version__ == importlib.metadata.version("resume-conformance") == declared


def test_draws_the_suite_could_not_deliver_are_counted_and_a_thin_green_verdict_says_so():
    from conformance.model import evidence
    from conformance.report import report
    evidence.take()
    for _ in range(3):
        evidence.drawn(True)
    for i in range(37):
        evidence.drawn(False, f"fs:{40 + i % 5} is past the run's last operation")
    (draws,) = [e for e in evidence.take() if isinstance(e, evidence.Draws)]
    assert (draws.delivered, draws.undelivered, len(draws.reasons)) == (3, 37, 3)
    assert draws.summary().startswith("3 of 40 drawn case(s) delivered; 37 could not be (e.g. fs:40 is past")
    assert evidence.Evidence.from_json(draws.to_json()) == draws
    evidence.drawn(True)
    assert not [e for e in evidence.take() if isinstance(e, evidence.Draws)]   # all delivered: nothing to say
    case = report.Case(check="no_lost_work[inside_save]", nodeid="x", outcome="passed", evidence=[draws])
    built = report.Report(versions={}, adapter=None, hypothesis_profile="conformance-ci", platform="", created="",
                          cases=[case])
    assert built.warnings == ["`no_lost_work[inside_save]` passed on " + draws.summary()]
    assert "**Warning**: `no_lost_work[inside_save]` passed on 3 of 40" in report.render_markdown(built)
