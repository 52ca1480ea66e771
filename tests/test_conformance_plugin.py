"""Meta-tests of how teams plug in: options, ini configuration, subclassing, Python adapters,
capability skips, and the warm runner giving the same results as a fresh interpreter."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from conformance.faults.scenario import run_schedule
from conformance.model.adapters import resolve
from conformance.model.crash import parse_schedule
from conformance.model.process import RunSpec
from conformance.run.fresh import SubprocessRunner
from conformance.run.runners import traced_run
from conformance.run.warm import WarmRunner

pytestmark = pytest.mark.slow


def test_subclass_with_python_adapter_and_capability_skip(tmp_path, run_pytest):
    (tmp_path / "test_team.py").write_text(textwrap.dedent('''
        from conformance import ResumeConformance

        class TestTeamTrainer(ResumeConformance):
            adapter = "resume_conformance.fixtures.python_adapter:ADAPTER"
    '''))
    proc = run_pytest("test_team.py", "-k", "determinism or schema_migration")
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "adapter lacks capability 'legacy_samples'" in proc.stdout


def test_the_collector_is_frozen_only_when_the_suite_runs(tmp_path, run_pytest):
    """The suite freezes what is loaded once the trainer's module is imported (plugin.py); a
    team's own tests, with the plugin merely installed, keep Python's collector as it was."""
    # Compared with what the interpreter starts with (3.12.1 starts with 375 frozen objects, 3.11: 0).
    at_start = int(subprocess.run([sys.executable, "-c", "import gc; print(gc.get_freeze_count())"],
                                  capture_output=True, text=True, check=True).stdout)
    (tmp_path / "test_plain.py").write_text(f"import gc\n\ndef test_plain():\n    assert gc.get_freeze_count() == {at_start}\n")
    (tmp_path / "test_team.py").write_text(textwrap.dedent('''
        import gc
        from conformance import ResumeConformance

        class TestTeamTrainer(ResumeConformance):
            adapter = "resume_conformance.fixtures.python_adapter:ADAPTER"

            def test_frozen(self):
                assert gc.get_freeze_count() > 1000 or AT_START


        def test_team_own():   # a team's own test beside the suite, after and before its tests
            assert gc.get_freeze_count() == AT_START
    ''').replace("AT_START", str(at_start)))
    plain = run_pytest("test_plain.py")
    assert "1 passed" in plain.stdout, plain.stdout[-3000:]
    suite = run_pytest("test_team.py", "-p", "no:randomly", "-k", "test_frozen or test_team_own")
    assert "2 passed" in suite.stdout, suite.stdout[-3000:]


def test_trainer_cmd_from_ini_makes_a_bare_pytest_the_gate(tmp_path, run_pytest):
    (tmp_path / "pytest.ini").write_text(textwrap.dedent(f'''
        [pytest]
        conformance_trainer_cmd = {sys.executable} -m resume_conformance.fixtures.reference_trainer
    '''))
    (tmp_path / "test_gate.py").write_text("from conformance.test_conformance import TestConformance\n")
    proc = run_pytest("test_gate.py", "-k", "determinism")
    assert "1 passed" in proc.stdout, proc.stdout[-3000:]


def test_bad_adapter_is_a_usage_error(run_pytest):
    proc = run_pytest("--pyargs", "conformance", "--adapter=no.such.module:X", "-k", "determinism")
    assert proc.returncode != 0
    assert "cannot use the trainer: adapter 'no.such.module:X': cannot import 'no.such.module'" in proc.stderr


@pytest.mark.parametrize("args, env, message, fix", [
    (["--adapter="], {}, "--adapter is empty, so the run would test the bundled reference trainer instead of yours",
     "fix: --adapter=package.module:attribute"),
    (["--trainer-cmd= "], {}, "--trainer-cmd is empty", "fix: --trainer-cmd=COMMAND"),
    ([], {"CONFORMANCE_TRAINER_CMD": "python train.py"}, "CONFORMANCE_TRAINER_CMD is set, but the suite takes the "
     "trainer only from --trainer-cmd or the ini key conformance_trainer_cmd", 'fix: --trainer-cmd="$CONFORMANCE_TRAINER_CMD"'),
    ([], {"CONFORMANCE_ADAPTER": "pkg.mod:ADAPTER"}, "CONFORMANCE_ADAPTER is set", 'fix: --adapter="$CONFORMANCE_ADAPTER"'),
    (["--hypothesis-profile=quik"], {}, "--hypothesis-profile='quik' is not a registered Hypothesis profile. The "
     "suite's profiles: conformance-quick (", "fix: --hypothesis-profile=conformance-quick"),
])
def test_a_trainer_or_profile_named_wrongly_is_one_usage_error_never_a_run_of_the_bundled_trainer(
        run_pytest, args, env, message, fix):
    proc = run_pytest("--pyargs", "conformance", *args, "-k", "determinism", env=env)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr and fix in proc.stderr, proc.stderr[-2000:]
    assert "INTERNALERROR" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_a_trainer_named_by_option_is_run_even_with_the_variable_set(run_pytest):
    proc = run_pytest("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.python_adapter:ADAPTER", "-k",
                      "determinism",
                      env={"CONFORMANCE_TRAINER_CMD": "python train.py"})
    assert "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("body, message", [
    ('adaptor = "resume_conformance.fixtures.python_adapter:ADAPTER"',
     "sets 'adaptor', which the suite does not read: did you mean 'adapter'?"),
    ('trainer_command = "python train.py"', "sets 'trainer_command', which the suite does not read: did you mean 'trainer_cmd'?"),
    ("pass", "names no trainer\n  fix: set the class attribute 'adapter'"),
])
def test_a_subclass_that_names_its_trainer_wrongly_is_one_usage_error(tmp_path, run_pytest, body, message):
    (tmp_path / "test_team.py").write_text(textwrap.dedent(f'''
        from conformance import ResumeConformance

        class TestTeamTrainer(ResumeConformance):
            {body}
    '''))
    for extra in ((), ("-n", "2")):
        proc = run_pytest("test_team.py", *extra)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "passed" not in out, out[-2000:]
        assert message in out, out[-2000:]


def test_conftest_defines_nothing_the_installed_plugin_needs(tmp_path, run_pytest, repo_root):
    """`pytest --pyargs conformance` collects the same checks, with the same options, from this
    checkout (whose conftest.py is loaded) as from anywhere else."""
    import conftest
    assert not hasattr(conftest, "pytest_addoption")
    from_checkout = run_pytest("--pyargs", "conformance", "--collect-only", cwd=repo_root)
    elsewhere = run_pytest("--pyargs", "conformance", "--collect-only", cwd=tmp_path)
    ids = [sorted(line.split("::", 1)[1] for line in p.stdout.splitlines() if "::" in line)
           for p in (from_checkout, elsewhere)]
    assert ids[0] and ids[0] == ids[1]
    helps = [run_pytest("--pyargs", "conformance", "--help", cwd=d).stdout for d in (repo_root, tmp_path)]
    assert "--expected-failures-lenient" in helps[1]
    options = [set(re.findall(r"^\s+(--[a-z][\w-]*)", h, re.MULTILINE)) for h in helps]
    assert options[0] == options[1]


@pytest.mark.needs_strace
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
        events = [(base.ops[i].syscall, base.role(i)) for i in base.mutations]
        outcomes[name] = (base.losses, events, [c.kill.text.split(":")[0] for c in outcome.crashed],
                          [c.resumed_from for c in outcome.crashed], outcome.final.losses, outcome.final.returncode)
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


def test_the_closing_lines_list_each_skip_with_why_and_the_report_is_written_by_default(tmp_path, run_pytest):
    proc = run_pytest("--pyargs", "conformance", "--hypothesis-profile=conformance-quick", "-k", "determinism or node_loss",
                      cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert "conformance: 1 check(s) did not run:" in lines, proc.stdout[-2000:]
    assert ("  node_loss: adapter lacks capability 'cold_tier' (or 'node_local_storage' in a job of several nodes: "
            "--nnodes >= 2)") in lines
    assert (tmp_path / "conformance-report" / "report.json").is_file() and \
        f"conformance report: {tmp_path / 'conformance-report' / 'report.json'}" in proc.stdout
