"""The first hour: the trainer is named up front, each usage mistake is one clear error, a
trainer that never ends is stopped with a message, failures show the report (not the suite's
source) and name a likely cause."""
from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from conformance.checks import all_check_ids

pytestmark = pytest.mark.slow

HANGS = textwrap.dedent("""\
    import json, os, time
    log = open(os.environ["CONFORMANCE_LOSS_LOG"], "a")
    for step in (1, 2, 3):
        log.write(json.dumps({"step": step, "loss": 1.0}) + "\\n"); log.flush()
    time.sleep(3600)
""")


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("ERROR")]


def test_the_header_names_trainer_profile_runner_and_strace(run_pytest):
    proc = run_pytest("--pyargs", "conformance", "--hypothesis-profile=conformance-quick", "--collect-only", "-v")
    header = next(line for line in proc.stdout.splitlines() if line.startswith("conformance: trainer"))
    assert header.startswith("conformance: trainer reference_trainer (resume_conformance.fixtures.reference_trainer:ADAPTER), "
                             "profile conformance-quick, runner warm (processes forked from one that imported torch")
    assert ", strace " in header and "syscall crash points " in header


def test_a_script_trainer_runs_warm_and_a_shell_wrapper_says_why_it_does_not(tmp_path, run_pytest):
    (tmp_path / "train.py").write_text("import resume_conformance.fixtures.reference_trainer\n")
    proc = run_pytest("--pyargs", "conformance", f"--trainer-cmd={sys.executable} train.py", "--collect-only", "-v")
    assert "runner warm (processes forked from one that imported torch and train.py once)" in proc.stdout
    (tmp_path / "train.sh").write_text("#!/bin/sh\nexec python -m resume_conformance.fixtures.reference_trainer\n")
    (tmp_path / "train.sh").chmod(0o755)
    proc = run_pytest("--pyargs", "conformance", "--trainer-cmd=./train.sh", "--collect-only", "-v")
    assert "runner fresh (the command does not start a Python interpreter, so every trainer process" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--adapter=nonexistent.mod:X"], "cannot import 'nonexistent.mod'"),
    (["--adapter=resume_conformance.fixtures.reference_trainer:NOPE"],
     "module 'resume_conformance.fixtures.reference_trainer' has no attribute 'NOPE'"),
    (["--adapter=no_colon_here"], "is not 'package.module:attribute'"),
    (["--trainer-cmd=/no/such/trainer --small"], "'/no/such/trainer' is not a program on PATH or a file"),
])
@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_usage_mistake_is_one_error_before_any_test_runs(run_pytest, args, message, workers):
    proc = run_pytest("--pyargs", "conformance", *args, *workers)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    errors = _errors(out)
    assert len(errors) == 1 and message in errors[0], out[-3000:]
    assert "  fix: " in out and "Traceback" not in out and "passed" not in out


@pytest.mark.parametrize("name, text", [
    ("pytest.ini", "[pytest]\nconformance_trainer_command = python train.py\n"),
    ("setup.cfg", "[tool:pytest]\nconformance_trainer_command = python train.py\n"),
    ("pyproject.toml", '[tool.pytest.ini_options]\nconformance_trainer_command = "python train.py"\n'),
])
def test_a_misspelt_ini_key_is_a_usage_error(tmp_path, run_pytest, name, text):
    (tmp_path / name).write_text(text)
    proc = run_pytest("--pyargs", "conformance", "-W", "error::pytest.PytestRemovedIn10Warning")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "unknown option 'conformance_trainer_command'" in proc.stderr
    assert "did you mean 'conformance_trainer_cmd'?" in proc.stderr
    assert "inicfg" not in proc.stdout + proc.stderr


def test_a_trainer_that_fails_fails_once(run_pytest):
    proc = run_pytest("--pyargs", "conformance", "--trainer-cmd=/bin/false", "--hypothesis-profile=conformance-quick")
    assert f"1 failed, {len(all_check_ids()) - 1} skipped" in proc.stdout, proc.stdout[-3000:]
    assert ("[determinism_precondition] an uninterrupted run of /bin/false exited 1 before it logged step 1: no check "
            "can run a trainer that does not start") in proc.stdout
    assert "  fix:      make the trainer start under the suite's environment" in proc.stdout   # not the determinism fix
    assert "could not tell which files" not in proc.stdout
    assert "the trainer's uninterrupted run failed (see determinism_precondition)" in proc.stdout


def test_a_trainer_that_ignores_total_steps_is_stopped_with_a_message(run_pytest):
    start = time.monotonic()
    proc = run_pytest("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.broken.ignores_total_steps:ADAPTER",
                      "--hypothesis-profile=conformance-quick")
    assert time.monotonic() - start < 120
    assert "the trainer ran past CONFORMANCE_TOTAL_STEPS (logged step" in proc.stdout, proc.stdout[-3000:]
    assert f"1 failed, {len(all_check_ids()) - 1} skipped" in proc.stdout


def test_a_trainer_that_hangs_is_stopped_within_its_limit(tmp_path, run_pytest):
    (tmp_path / "hangs.py").write_text(HANGS)
    start = time.monotonic()
    proc = run_pytest("--pyargs", "conformance", f"--trainer-cmd={sys.executable} hangs.py",
                      "--process-timeout=24", "-k", "determinism")
    assert time.monotonic() - start < 90
    # Stalled for half the limit: stopped long before the whole limit (a loaded machine may take
    # seconds to reach step 3, which the stall limit leaves room for).
    assert "the first uninterrupted run: the trainer made no progress for 12 s after step 3" in proc.stdout, \
        proc.stdout[-3000:]


def test_an_adapter_imports_from_the_current_directory_under_plain_pytest(tmp_path, run_pytest):
    (tmp_path / "mytrain").mkdir()
    (tmp_path / "mytrain" / "__init__.py").write_text("")
    (tmp_path / "mytrain" / "train.py").write_text(
        "from resume_conformance.fixtures.python_adapter import ADAPTER  # noqa: F401\n")
    # This interpreter's own `pytest` script (not the first on PATH: an unactivated venv's PATH
    # finds another interpreter's, without the plugin): plain pytest does not put the current
    # directory on sys.path the way `python -m pytest` does.
    pytest_exe = Path(sys.executable).with_name("pytest")
    if not pytest_exe.exists():
        pytest.skip(f"no pytest script beside {sys.executable}")
    import subprocess
    proc = subprocess.run([pytest_exe, "-p", "no:cacheprovider", "-q", "--pyargs", "conformance",
                           "--adapter=mytrain.train:ADAPTER", "-k", "determinism", f"--basetemp={tmp_path / 'bt'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.needs_strace
def test_failures_show_the_report_not_the_suites_source(run_pytest):
    args = ("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.broken.optimizer_not_saved:ADAPTER",
            "--hypothesis-profile=conformance-quick", "-k", "resume_matches_baseline")
    proc = run_pytest(*args)
    assert proc.stdout.count("  plot:     ") == 1 and proc.stdout.count("  replay:   ") == 1, proc.stdout[-4000:]
    assert "conformance/checks/" not in proc.stdout and "def run(" not in proc.stdout
    assert ("conformance: tested optimizer_not_saved "
            "(resume_conformance.fixtures.broken.optimizer_not_saved:ADAPTER)") in proc.stdout
    loud = run_pytest(*args, "-vvv")   # -vv on top of the fixture's -q
    assert "conformance/checks/schedules.py" in loud.stdout


@pytest.mark.needs_strace
@pytest.mark.parametrize("trainer, cause", [
    ("numpy_rng_not_saved", "likely cause: RNG state"),
    ("skip_to_next_epoch", "likely cause: the data position"),
    ("optimizer_not_saved", "likely cause: optimizer state"),
    ("iterator_after_rng_restore", "likely cause: RNG state, right after the resumed process's set-up and not "
                                   "through the seed"),
])
def test_a_diverging_resume_names_its_likely_cause(run_suite, trainer, cause):
    verdicts, out = run_suite(f"--adapter=resume_conformance.fixtures.broken.{trainer}:ADAPTER",
                              "--hypothesis-profile=conformance-quick",
                              "-k", "resume_matches_baseline")
    outcome, message = verdicts["test_resume_matches_baseline"]
    assert outcome == "failed" and cause in message, message
    assert "    - state digests the trainer logged: " in message   # the bundled trainers log them
