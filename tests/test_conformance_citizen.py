"""The suite in other people's environments: it claims only its own names (installed packages,
options, Hypothesis profiles), says which part of a misspelled adapter failed, and its replay line
carries every option that changes a verdict."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEIGHBOURS_PYTHON = Path(os.environ.get("CONFORMANCE_NEIGHBOURS_PYTHON", REPO / ".venv-neighbours" / "bin" / "python"))
README_FIRST = ["-m", "pytest", "--pyargs", "conformance", "-n", "auto", "-p", "no:cacheprovider",
                "--hypothesis-profile=conformance-ci"]


# -- installed names -------------------------------------------------------------------------------
def test_the_wheel_lists_every_package_folder_under_the_projects_name():
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: name for name, folder in table["package-dir"].items()}
    expected = set()
    for init in REPO.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(REPO).parts
        if parts[0] in ("conformance", "fixtures", "reference"):
            top = mapped.get(parts[0], parts[0])
            expected.add(".".join([top, *parts[1:]]))
    assert set(table["packages"]) == expected
    assert not [p for p in table["packages"] if p.split(".")[0] in ("fixtures", "reference")]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_a_bundled_trainers_old_spelling_names_the_new_one(tmp_path):
    proc = _python("""
        from conformance.model.adapters import python_adapter
        print(python_adapter("fixtures.broken.no_fsync:ADAPTER", ()).spec)
    """, tmp_path)
    assert proc.stdout.strip() == "resume_conformance.fixtures.broken.no_fsync:ADAPTER", proc.stderr
    assert proc.stderr.strip() == ("conformance: 'fixtures.broken.no_fsync' is now spelled "
                                   "'resume_conformance.fixtures.broken.no_fsync': give "
                                   "resume_conformance.fixtures.broken.no_fsync:ADAPTER")


def test_a_projects_own_fixtures_package_stays_its_own(tmp_path):
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "__init__.py").write_text("")
    (tmp_path / "fixtures" / "reference_trainer.py").write_text("ADAPTER = 'the team s own'\n")
    proc = _python("""
        import os
        from conformance.model.adapters import load_object, BUNDLED
        print(load_object("fixtures.reference_trainer:ADAPTER", (os.getcwd(),)))
        print(load_object(BUNDLED, (os.getcwd(),)).name)
    """, tmp_path)
    assert proc.stdout.splitlines() == ["the team s own", "reference_trainer"], proc.stderr
    assert "now spelled" not in proc.stderr
    # A `fixtures` that lacks the bundled module (testing-cabal's has no `fixtures.broken`): the new spelling.
    proc = _python("""
        import os
        from conformance.model.adapters import python_adapter
        print(python_adapter("fixtures.broken.no_fsync:ADAPTER", (os.getcwd(),)).spec)
    """, tmp_path)
    assert proc.stdout.strip() == "resume_conformance.fixtures.broken.no_fsync:ADAPTER", proc.stderr


@pytest.mark.parametrize("spec, cause, fix", [
    ("resume_conformance.fixtures.broken.no_fsnc:ADAPTER",
     "'resume_conformance.fixtures.broken' has no module 'no_fsnc' (did you mean "
     "'resume_conformance.fixtures.broken.no_fsync'?)", "check the spelling of 'no_fsnc'"),
    ("mytrain.conformance_adaptr:ADAPTER", "'mytrain' has no module 'conformance_adaptr' (did you mean "
     "'mytrain.conformance_adapter'?)", "check the spelling of 'conformance_adaptr': mytrain.conformance_adapter"),
    ("mytrian.conformance_adapter:ADAPTER", "no module 'mytrian' on sys.path or in",
     "run pytest from the directory that holds 'mytrian', or install that package; or spell it 'mytrain'"),
    ("mytrain.needs_missing:ADAPTER", "it exists, but importing it failed: No module named 'not_installed_x'",
     "install 'not_installed_x' in this environment"),
    ("mytrain.needs_extra:ADAPTER", "it exists, but importing it failed: needs torchdata: pip install x[torchdata]",
     "install what it names in this environment"),
])
def test_an_adapter_that_cannot_be_imported_names_the_part_that_failed(tmp_path, spec, cause, fix):
    (tmp_path / "mytrain").mkdir()
    (tmp_path / "mytrain" / "__init__.py").write_text("")
    (tmp_path / "mytrain" / "conformance_adapter.py").write_text("ADAPTER = None\n")
    (tmp_path / "mytrain" / "needs_missing.py").write_text("import not_installed_x\n")
    (tmp_path / "mytrain" / "needs_extra.py").write_text("raise ImportError('needs torchdata: pip install x[torchdata]')\n")
    proc = _python(f"""
        import os
        from conformance.model.adapters import AdapterError, python_adapter
        try:
            python_adapter({spec!r}, (os.getcwd(),))
        except AdapterError as exc:
            print(exc)
    """, tmp_path)
    assert cause in proc.stdout and f"fix: {fix}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("command, message", [
    ("python -m megatrain.trian", "'megatrain' has no module 'trian' (did you mean 'megatrain.train'?)"),
    ("python trian.py", "the script 'trian.py' does not exist"),
])
def test_a_trainer_command_python_cannot_find_is_one_usage_error_before_any_check(tmp_path, run_pytest, command, message):
    (tmp_path / "megatrain").mkdir()
    (tmp_path / "megatrain" / "__init__.py").write_text("")
    (tmp_path / "megatrain" / "train.py").write_text("")
    proc = run_pytest("--pyargs", "conformance", f"--trainer-cmd={command.replace('python', sys.executable, 1)}")
    assert proc.returncode == 4 and message in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "passed" not in proc.stdout and "Traceback" not in proc.stderr


def test_resume_python_of_an_environment_without_the_suite_says_what_to_install(tmp_path, run_pytest):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "old")], check=True)
    old = tmp_path / "old" / "bin" / "python"
    proc = run_pytest("--pyargs", "conformance", f"--resume-python={old}", "-k", "upgrade_resume")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--resume-python {old}: that environment cannot import this suite (ModuleNotFoundError: No module " \
           "named 'conformance')" in proc.stderr
    assert f"fix: {old} -m pip install --no-deps -e {REPO}" in proc.stderr


# -- options ---------------------------------------------------------------------------------------
def test_a_short_spelling_another_plugin_registers_stays_theirs(tmp_path, run_pytest):
    """pytest refuses to start when two plugins register one flag: the suite's --adapter steps aside."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        def pytest_addoption(parser):
            parser.addoption("--adapter", dest="their_adapter", default=None)
            parser.addoption("--runner", dest="their_runner", default=None)
    """))
    (tmp_path / "test_theirs.py").write_text(textwrap.dedent("""
        def test_options(pytestconfig):
            assert pytestconfig.getoption("their_adapter") == "theirs"
            assert pytestconfig.getoption("their_runner") == "fast"
            assert pytestconfig.getoption("conformance_adapter") == "resume_conformance.fixtures.python_adapter:ADAPTER"
            assert pytestconfig.getoption("conformance_loss_tol") == "0.001"
    """))
    proc = run_pytest("test_theirs.py", "--adapter=theirs", "--runner=fast", "--loss-tol=0.001",
                      "--conformance-adapter=resume_conformance.fixtures.python_adapter:ADAPTER")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("given", [["--loss-tol=abc"], ["--grace-seconds=-1"], ["--process-timeout=0"],
                                   ["-o", "conformance_grace_seconds=soon"]])
def test_every_number_option_gets_one_usage_error_from_the_command_line_or_the_ini(run_pytest, given):
    proc = run_pytest("--pyargs", "conformance", *given, "-k", "determinism_precondition")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "conformance usage error: --" in proc.stderr and "fix: --" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# A value other than the default for every option that changes a verdict (model/flags.py: verdict=True).
NON_DEFAULT = {"loss_tol": 1e-3, "process_timeout": 90.0, "grace_seconds": 30.0, "hang_timeout": 60.0,
               "cold_url": "s3://bucket/run", "resume_python": sys.executable}
SESSION_NAMES = {"loss_tol": "tol", "grace_seconds": "grace_s", "cold_url": "cold"}


def test_the_replay_line_carries_every_option_that_changes_a_verdict(tmp_path):
    from conformance.__main__ import build_parser
    from conformance.checks import Session
    from conformance.checks.failures import replay_command
    from conformance.model.adapters import resolve
    from conformance.model.flags import FLAGS
    from conformance.model.process import RunSpec
    assert set(NON_DEFAULT) == {f.name for f in FLAGS if f.verdict}, "a new verdict option needs a value here"
    session = Session(resolve(None, None), tmp_path / "s", **{SESSION_NAMES.get(k, k): v for k, v in NON_DEFAULT.items()})
    line = replay_command(session.adapter, "preemption", RunSpec(14, 3, 0))
    session.close()
    args = vars(build_parser().parse_args(shlex.split(line)[3:]))
    for name, value in NON_DEFAULT.items():
        assert args[name] == value, (name, line)
    default = Session(resolve(None, None), tmp_path / "d")
    assert replay_command(default.adapter, "preemption", RunSpec(14, 3, 0)).endswith("--seed=0")
    default.close()


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_replay_with_non_default_options_reproduces_the_verdict_and_its_replay_line(tmp_path):
    trainer = "resume_conformance.fixtures.broken.numpy_rng_not_saved:ADAPTER"
    proc = subprocess.run([sys.executable, "-m", "conformance", "replay", f"--adapter={trainer}",
                           "--check=resume_matches_baseline", "--total-steps=14", "--save-every=3", "--seed=0",
                           "--schedule=step:10", "--grace-seconds=30", "--loss-tol=0.001"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and proc.stdout.startswith("FAIL"), proc.stdout[-2000:] + proc.stderr[-2000:]
    replay = next(line for line in proc.stdout.splitlines() if line.strip().startswith("replay:"))
    assert "--grace-seconds=30" in replay and "--loss-tol=0.001" in replay, replay


# -- Hypothesis profiles ----------------------------------------------------------------------------
def test_the_plugin_registers_no_profile_outside_its_namespace():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from hypothesis import settings
        before = set(settings._profiles)
        import conformance.plugin, conformance.cli.soak
        print(sorted(set(settings._profiles) - before))
    """)], capture_output=True, text=True, timeout=120)
    added = eval(proc.stdout)
    assert added and all(name.startswith("conformance-") for name in added), added


def test_the_suites_tests_run_under_the_gate_profile_unless_one_of_its_own_is_chosen():
    from conformance.model.settings import suite_profile
    assert suite_profile("default") == "conformance-ci"
    assert suite_profile("my-teams-ci") == "conformance-ci"
    assert suite_profile("ci") == "conformance-ci" and suite_profile("quick") == "conformance-quick"
    assert suite_profile("conformance-fuzz") == "conformance-fuzz"
    assert suite_profile("conformance-ci-random") == "conformance-ci-random"


def test_a_gate_run_without_a_profile_runs_the_suites_tests_under_the_seeded_gate_profile(tmp_path, run_pytest):
    import json
    proc = run_pytest("--pyargs", "conformance", "--adapter=resume_conformance.fixtures.python_adapter:ADAPTER",
                      "-k", "determinism_precondition")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = json.loads((tmp_path / "conformance-report" / "report.json").read_text())
    assert written["hypothesis_profile"] == "conformance-ci"
    assert ", profile conformance-ci" in written["header"]


def test_a_teams_own_ci_profile_stays_theirs(tmp_path, run_pytest):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        from hypothesis import settings
        settings.register_profile("ci", max_examples=2)
    """))
    (tmp_path / "test_theirs.py").write_text(textwrap.dedent("""
        from hypothesis import settings
        def test_profile():
            assert settings.default.max_examples == 2
    """))
    proc = run_pytest("test_theirs.py", "--hypothesis-profile=ci")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- beside other plugins and testing-cabal's `fixtures` ---------------------------------------------
@pytest.mark.slow
def test_readme_first_command_beside_pytest_cov_timeout_randomly_and_fixtures_4(tmp_path):
    """One venv (.ci/run makes it) holds fixtures==4.3.2, pytest-cov, pytest-timeout and
    pytest-randomly beside this project; xdist is there already."""
    if not NEIGHBOURS_PYTHON.exists():
        pytest.skip(f"no neighbours venv at {NEIGHBOURS_PYTHON} (.ci/run makes one)")
    python = str(NEIGHBOURS_PYTHON)
    which = subprocess.run([python, "-c", "import fixtures; print(fixtures.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert which.returncode == 0 and str(NEIGHBOURS_PYTHON.parent.parent) in which.stdout, which.stdout + which.stderr
    assert subprocess.run([python, "-c", "import fixtures; fixtures.Fixture; fixtures.TempDir"],
                          cwd=tmp_path).returncode == 0
    plugins = subprocess.run([python, "-m", "pytest", "--version", "--version"], capture_output=True, text=True)
    for name in ("pytest-cov", "pytest-timeout", "pytest-randomly", "pytest-xdist", "resume-conformance"):
        assert name in plugins.stdout + plugins.stderr, plugins.stdout + plugins.stderr
    (tmp_path / "fixtures").mkdir()     # a team's own `fixtures` package, where the command runs
    (tmp_path / "fixtures" / "__init__.py").write_text("TEAM = True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run([python, *README_FIRST, "--timeout=900", "--cov=conformance", "--cov-report="],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "resume_conformance.fixtures.reference_trainer:ADAPTER" in proc.stdout


# -- other systems ------------------------------------------------------------------------------------
ELSEWHERE = """
import signal, sys
for name in ("SIGRTMIN", "SIGRTMAX", "sigwaitinfo", "SIGBUS"):   # what macOS or Windows lack
    if hasattr(signal, name):
        delattr(signal, name)
import pytest
import conformance.options
conformance.options.PLATFORM = "darwin"
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_on_another_system_the_suite_is_one_usage_error_and_a_teams_tests_still_run(tmp_path):
    (tmp_path / "test_theirs.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_subclass.py").write_text(
        "from conformance import ResumeConformance\n\nclass TestMine(ResumeConformance):\n    adapter = 'x:Y'\n")
    run = lambda *args: subprocess.run([sys.executable, "-c", ELSEWHERE, "-p", "no:cacheprovider", "-q", *args],  # noqa: E731
                                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    theirs = run("test_theirs.py")
    assert theirs.returncode == 0 and "1 passed" in theirs.stdout, theirs.stdout[-2000:] + theirs.stderr[-2000:]
    for args in (["--pyargs", "conformance"], ["test_subclass.py"]):
        proc = run(*args)
        out = proc.stdout + proc.stderr
        assert proc.returncode in (2, 4) and "the conformance suite runs on Linux only (this is darwin)" in out, out[-2000:]
        assert "fix: run it on a Linux machine, in a Linux container" in out and "Traceback" not in out
