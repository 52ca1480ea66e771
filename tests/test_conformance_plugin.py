"""Meta-tests of how teams plug in: options, ini configuration, subclassing, Python adapters,
capability skips, and the warm runner giving the same results as a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.adapters import resolve
from conformance.crash import parse_schedule
from conformance.scenario import run_schedule
from conformance.tracing import strace_problem
from conformance.trials import RunSpec, SubprocessRunner, WarmRunner, traced_run

pytestmark = pytest.mark.slow


def pytest_in(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           "-W", "ignore::DeprecationWarning", f"--basetemp={tmp_path / 'bt'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


def test_subclass_with_python_adapter_and_capability_skip(tmp_path):
    (tmp_path / "test_team.py").write_text(textwrap.dedent('''
        from conformance import ResumeConformance

        class TestTeamTrainer(ResumeConformance):
            adapter = "fixtures.python_adapter:ADAPTER"
    '''))
    proc = pytest_in(tmp_path, "test_team.py", "-k", "determinism or schema_migration")
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "adapter lacks capability 'legacy_samples'" in proc.stdout


def test_trainer_cmd_from_ini_makes_a_bare_pytest_the_gate(tmp_path):
    (tmp_path / "pytest.ini").write_text(textwrap.dedent(f'''
        [pytest]
        conformance_trainer_cmd = {sys.executable} -m fixtures.reference_trainer
    '''))
    (tmp_path / "test_gate.py").write_text("from conformance.test_conformance import TestConformance\n")
    proc = pytest_in(tmp_path, "test_gate.py", "-k", "determinism")
    assert "1 passed" in proc.stdout, proc.stdout[-3000:]


def test_bad_adapter_is_a_usage_error(tmp_path):
    proc = pytest_in(tmp_path, "--pyargs", "conformance", "--adapter=no.such.module:X", "-k", "determinism")
    assert proc.returncode != 0
    assert "cannot load the trainer adapter" in proc.stdout + proc.stderr


@pytest.mark.skipif(strace_problem() is not None, reason=f"strace unusable: {strace_problem()}")
@pytest.mark.parametrize("schedule", ["fs:5", "step:4,fs:12"])
def test_warm_runner_matches_a_fresh_interpreter(tmp_path, schedule):
    adapter, spec = resolve(None, None), RunSpec(12, 3, 0)
    outcomes = {}
    for name, runner in (("fresh", SubprocessRunner()), ("warm", WarmRunner())):
        try:
            base = traced_run(runner, adapter, spec, tmp_path / name)
            outcome = run_schedule(runner, adapter, spec, parse_schedule(schedule), tmp_path / name / "trial", base)
        finally:
            getattr(runner, "close", lambda: None)()
        # The per-thread counts (`nth`) differ between runners (imports are already done in a
        # forked child); what the trainer does to the checkpoint directory must not.
        events = [(e.syscall, e.describe(base.ckpt_dir).split(".tmp-")[0]) for e in base.events]
        outcomes[name] = (base.losses, events, [c.planned_text.split(".tmp-")[0] for c in outcome.crashed],
                          outcome.resume_points, outcome.final.losses, outcome.final.returncode)
    assert outcomes["warm"] == outcomes["fresh"]


def test_warm_runner_runs_processes_concurrently_with_their_own_results(tmp_path):
    """Crash states are checked several at a time on one fork server: every child gets its own
    environment, exit status and loss log, and a child that fails does not disturb the others."""
    from concurrent.futures import ThreadPoolExecutor
    adapter = resolve(None, None)
    runner = WarmRunner()

    def run(i: int):
        d = tmp_path / f"p{i}"
        (d / "ckpt").mkdir(parents=True)
        spec = RunSpec(3 + i % 3, 2, i)
        if i == 5:   # an unusable checkpoint directory: this child must fail on its own
            (d / "ckpt").rmdir()
            (d / "ckpt").write_text("not a directory")
        return i, spec, runner.run_process(adapter, spec, (d / "ckpt").resolve(), (d / "loss.jsonl").resolve())

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(run, range(8)))
    finally:
        runner.close()
    for i, spec, result in results:
        if i == 5:
            assert result.returncode != 0 and result.stderr.strip()
            continue
        assert result.returncode == 0, result.stderr
        assert sorted(result.losses) == list(range(1, spec.total_steps + 1))
    # Same run, same losses, whichever order the concurrent children ran in.
    by_spec = {}
    for i, spec, result in results:
        if i != 5:
            by_spec.setdefault((spec.total_steps, spec.seed), []).append(result.losses)
    (d := tmp_path / "again" / "ckpt").mkdir(parents=True)
    again = WarmRunner()
    try:
        repeat = again.run_process(adapter, RunSpec(4, 2, 1), d.resolve(), (d.parent / "loss.jsonl").resolve())
    finally:
        again.close()
    assert by_spec[(4, 1)] == [repeat.losses]
