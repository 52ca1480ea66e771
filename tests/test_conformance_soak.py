"""`python -m conformance soak`: options, seeds, the pytest command of a run, the burners (no real
suite run here; tests/test_conformance_report.py runs one soak end to end)."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from conformance.__main__ import build_parser, main
from conformance.cli import soak
from conformance.cli.load import Burners
from conformance.model.settings import PROFILES, SEEDED_PROFILES

REF = "resume_conformance.fixtures.reference_trainer:ADAPTER"


def parse(*argv: str):
    return build_parser().parse_args(["soak", *argv])


def planned(*argv: str, tmp_path: Path) -> soak.Plan:
    return soak.plan(parse(*argv, "--out", str(tmp_path)), check_trainer=lambda trainer, world_size: None)


# -- the parser and the options' checks -----------------------------------------------------------

def test_the_parser_keeps_adapters_and_trainer_commands_as_one_ordered_list_of_trainers():
    args = parse("--adapter", "a.b:C", "--trainer-cmd", "python train.py --small", "--adapter", "d:E",
                 "--world-size", "2", "--random", "--seed", "7", "--load", "3", "--runs", "4", "--workers", "0")
    assert args.trainers == [soak.Trainer(adapter="a.b:C"), soak.Trainer(trainer_cmd="python train.py --small"),
                             soak.Trainer(adapter="d:E")]
    assert (args.world_size, args.random, args.seed, args.load, args.runs, args.workers) == ("2", True, 7, 3, 4, "0")
    defaults = parse()
    assert (defaults.trainers, defaults.runs, defaults.profile, defaults.random, defaults.seed, defaults.load,
            defaults.workers, defaults.world_size) == (None, 3, "conformance-ci", False, None, 0, "auto", None)


@pytest.mark.parametrize("argv, message", [
    (["--load", "-1"], "argument --load: must be >= 0"),
    (["--load", "x"], "argument --load: not a whole number"),
    (["--runs", "0"], "argument --runs: must be >= 1"),
    (["--workers", "many"], "argument --workers: must be 'auto', 'logical' or a number"),
])
def test_bad_numbers_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["soak", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--random", "--profile", "nightly"],
     "--random needs one of the suite's profiles (conformance-quick, conformance-ci, conformance-fuzz)"),
    (["--seed", "3"], "--seed sets the draws of a --random campaign; add --random"),
    (["--adapter", "no_such_module_here:ADAPTER"], "cannot use the trainer no_such_module_here:ADAPTER"),
    (["--trainer-cmd", "no-such-program-here --x"], "cannot use the trainer cmd:no-such-program-here --x"),
    (["--trainer-cmd", ""], "--trainer-cmd is empty"),
    (["--adapter", " "], "--adapter is empty"),
    (["--adapter", REF, "--world-size", "0"], "--world-size is '0', not a whole number >= 1"),
])
def test_bad_combinations_and_unresolvable_trainers_are_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: pytest.fail(f"a run started: {cmd}"))
    assert main(["soak", *argv, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.err.startswith("python -m conformance soak: error: ")
    assert captured.out == ""   # nothing ran


def test_without_trainers_the_projects_correct_trainers_are_soaked(tmp_path):
    from resume_conformance.fixtures import CORRECT_TRAINERS
    plan = planned(tmp_path=tmp_path)
    assert [t.adapter for t in plan.trainers] == list(CORRECT_TRAINERS)


# -- default trainers that cannot be loaded here (an optional extra not installed) -----------------

CAREFUL = "resume_conformance.fixtures.careful_loop:ADAPTER"   # needs the torchdata extra


@pytest.fixture
def without_torchdata(monkeypatch):
    """This interpreter as if the torchdata extra were not installed: careful_loop raises its ImportError."""
    for name in [n for n in sys.modules if n == "torchdata" or n.startswith("torchdata.")] + ["torchdata"]:
        monkeypatch.setitem(sys.modules, name, None)   # None: `import torchdata...` raises ImportError
    monkeypatch.delitem(sys.modules, CAREFUL.partition(":")[0], raising=False)   # imported afresh (restored after)


def test_without_trainers_one_that_needs_a_missing_extra_is_skipped_with_the_reason(capsys, tmp_path, monkeypatch,
                                                                                     without_torchdata):
    from resume_conformance.fixtures import CORRECT_TRAINERS
    ran = []
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: ran.append(cmd) or soak.Outcome({"passed": 1}, []))
    assert main(["soak", "--runs", "1", "--workers", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    soaked = [next(a.partition("=")[2] for a in cmd if a.startswith("--conformance-adapter=")) for cmd in ran]
    # Every default trainer either ran, in order, or has one skip line before the campaign's first
    # (an environment without other extras, e.g. safetensors, skips more than the one hidden here).
    skips = [line for line in out if line.startswith("soak: skipping ")]
    assert out[:len(skips)] == skips and out[len(skips)].startswith(f"soak: 1 run(s) x {len(soaked)} trainer(s)")
    assert soaked == [spec for spec in CORRECT_TRAINERS if not any(line.startswith(f"soak: skipping {spec}: ")
                                                                   for line in skips)]
    assert CAREFUL not in soaked and soaked
    skip = f"soak: skipping {CAREFUL}: {CAREFUL.partition(':')[0]} needs torchdata: pip install resume-conformance[torchdata]"
    assert skip in skips and all(line.count(": ") >= 2 for line in skips)   # each with its reason
    assert not any("fix:" in line or "run pytest from" in line for line in out)


def test_a_named_trainer_that_needs_a_missing_extra_stays_a_usage_error(capsys, tmp_path, monkeypatch, without_torchdata):
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: pytest.fail(f"a run started: {cmd}"))
    assert main(["soak", "--adapter", CAREFUL, "--adapter", REF, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"python -m conformance soak: error: cannot use the trainer {CAREFUL}: ")
    assert captured.out == ""


@pytest.fixture
def default_trainers(tmp_path, monkeypatch):
    """DEFAULT_SOAK as a module of `tmp_path` listing the given specs; `extra_module(name)`: a module
    there that raises the ImportError of a trainer whose extra is not installed."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def extra_module(name: str, extra: str) -> str:
        (tmp_path / f"{name}.py").write_text(
            "try:\n    import no_such_extra_package_here\nexcept ImportError as exc:\n"
            f"    raise ImportError('{name} needs {extra}: pip install resume-conformance[{extra}]') from exc\n")
        made.append(name)
        return f"{name}:ADAPTER"

    def defaults(*specs: str) -> None:
        name = f"soak_defaults_{len(made)}"
        (tmp_path / f"{name}.py").write_text(f"TRAINERS = {specs!r}\n")
        made.append(name)
        monkeypatch.setattr(soak, "DEFAULT_SOAK", f"{name}:TRAINERS")
    yield extra_module, defaults
    for name in made:
        sys.modules.pop(name, None)


def test_a_default_list_with_an_unloadable_spec_keeps_the_others_in_order(capsys, tmp_path, monkeypatch, default_trainers):
    extra_module, defaults = default_trainers
    frob = extra_module("soak_frob_trainer", "frob")
    defaults(REF, frob, "resume_conformance.fixtures.temp_names:MKSTEMP")
    plan = soak.plan(parse("--out", str(tmp_path)))
    assert [t.label for t in plan.trainers] == [REF, "resume_conformance.fixtures.temp_names:MKSTEMP"]
    assert plan.skipped == ((frob, "soak_frob_trainer needs frob: pip install resume-conformance[frob]"),)
    lines = []
    assert soak.campaign(plan, run=lambda cmd, d: soak.Outcome({"passed": 1}, []), out=lambda *a, **k: lines.append(a[0])) == 0
    assert lines[0] == f"soak: skipping {frob}: soak_frob_trainer needs frob: pip install resume-conformance[frob]"
    assert lines[1].startswith("soak: 3 run(s) x 2 trainer(s)")
    runs = [line.split()[0] for line in lines if "/3 seed" in line]
    assert runs == [REF] * 3 + ["resume_conformance.fixtures.temp_names:MKSTEMP"] * 3


def test_when_no_default_trainer_can_be_loaded_it_is_a_usage_error_saying_why(capsys, tmp_path, monkeypatch, default_trainers):
    extra_module, defaults = default_trainers
    frob, quux = extra_module("soak_frob_only", "frob"), extra_module("soak_quux_only", "quux")
    defaults(frob, quux)
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: pytest.fail(f"a run started: {cmd}"))
    assert main(["soak", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "python -m conformance soak: error: none of the default trainers (soak_defaults_2:TRAINERS) can be loaded here:",
        f"  {frob}: soak_frob_only needs frob: pip install resume-conformance[frob]",
        f"  {quux}: soak_quux_only needs quux: pip install resume-conformance[quux]"]


def test_an_injected_check_can_skip_a_default_trainer_and_other_problems_stay_usage_errors(tmp_path):
    from resume_conformance.fixtures import CORRECT_TRAINERS

    def check(trainer, world_size):
        if trainer.adapter == CAREFUL:
            raise soak.TrainerUnloadable(f"cannot use the trainer {CAREFUL}", "needs torchdata:\n pip install x[torchdata]")
    plan = soak.plan(parse("--out", str(tmp_path)), check_trainer=check)
    assert [t.adapter for t in plan.trainers] == [spec for spec in CORRECT_TRAINERS if spec != CAREFUL]
    assert plan.skipped == ((CAREFUL, "needs torchdata: pip install x[torchdata]"),)   # on one line

    def broken(trainer, world_size):
        raise soak.SoakUsageError(f"--world-size is {world_size!r}, not a whole number >= 1")
    with pytest.raises(soak.SoakUsageError, match="--world-size is '0'"):   # not a trainer to skip: the options are wrong
        soak.plan(parse("--out", str(tmp_path), "--world-size", "0"), check_trainer=broken)


# -- seeds ----------------------------------------------------------------------------------------

def test_run_seeds_are_a_deterministic_function_of_the_campaign_seed_and_distinct_per_run():
    seeds = [soak.run_seed(7, i) for i in range(1, 1001)]
    assert seeds == [soak.run_seed(7, i) for i in range(1, 1001)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2 ** 32 for s in seeds)
    assert seeds[:5] != [soak.run_seed(8, i) for i in range(1, 6)]
    assert soak.run_seed(7, 1) == 1124888932   # fixed across versions: an old campaign's seed replays


def test_the_same_seed_plans_the_same_campaign_and_no_seed_draws_a_new_printed_one(tmp_path):
    one, two = (planned("--random", "--seed", "7", "--runs", "3", tmp_path=tmp_path) for _ in range(2))
    assert one.campaign_seed == two.campaign_seed == 7
    assert [one.seed(i) for i in (1, 2, 3)] == [two.seed(i) for i in (1, 2, 3)] == [soak.run_seed(7, i) for i in (1, 2, 3)]
    fresh = {planned("--random", tmp_path=tmp_path).campaign_seed for _ in range(3)}
    assert None not in fresh and len(fresh) > 1
    fixed = planned("--runs", "2", tmp_path=tmp_path)
    assert (fixed.campaign_seed, fixed.seed(1), fixed.seed_text(1)) == \
        (None, None, f"{SEEDED_PROFILES['conformance-ci']} (fixed)")
    assert planned("--profile", "fuzz", tmp_path=tmp_path).seed_text(1) == "unseeded"


# -- the pytest command of a run ------------------------------------------------------------------

def test_the_command_carries_the_trainer_world_size_profile_seed_and_report(tmp_path):
    trainer = soak.Trainer(trainer_cmd="python train.py --small")
    cmd = soak.build_command(trainer, profile="conformance-ci", seed=12345, world_size="2", workers="auto",
                             report_dir=tmp_path / "r", basetemp=tmp_path / "t", python="PY")
    assert cmd[:8] == ["PY", "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q"]
    assert ["-p", "conformance.cli.soak"] == cmd[8:10]   # registers ci-random in the pytest process
    assert {"--conformance-trainer-cmd=python train.py --small", "--conformance-world-size=2",
            "--hypothesis-profile=conformance-ci-random",
            "--hypothesis-seed=12345", f"--conformance-report={tmp_path / 'r'}", f"--basetemp={tmp_path / 't'}"} <= set(cmd)
    assert cmd[-2:] == ["-n", "auto"]


def test_select_keeps_a_campaign_to_some_checks_in_every_run_and_its_replays(tmp_path):
    plan = planned("--adapter", REF, "--select", "interrupt or hang", tmp_path=tmp_path)
    cmd = plan.command(plan.trainers[0], 1)
    assert cmd[cmd.index("-k") + 1] == "interrupt or hang"
    replay = plan.command(plan.trainers[0], 1, select="test_hang")   # a failure's replay: just its check
    assert replay[replay.index("-k") + 1] == "test_hang"
    assert "-k" not in planned("--adapter", REF, tmp_path=tmp_path).command(soak.Trainer(adapter=REF), 1)


def test_shards_of_one_campaign_draw_disjoint_runs_that_together_are_the_whole_campaign(tmp_path):
    whole = planned("--random", "--seed", "7", "--runs", "6", tmp_path=tmp_path)
    shards = [planned("--random", "--seed", "7", "--runs", "2", "--shard", f"{i}/3", tmp_path=tmp_path)
              for i in (1, 2, 3)]
    drawn = [p.seed(k) for p in shards for k in (1, 2)]
    assert len(set(drawn)) == 6 and set(drawn) == {whole.seed(k) for k in range(1, 7)}
    assert shards[1].campaign_run(2) == 5


@pytest.mark.parametrize("argv, message", [
    (["--shard", "1/2"], "--shard splits one --random campaign"),
    (["--random", "--shard", "1/2"], "--shard splits one --random campaign"),
])
def test_a_shard_without_a_shared_campaign_seed_is_a_usage_error(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: pytest.fail(f"a run started: {cmd}"))
    assert main(["soak", "--adapter", REF, *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("shard", ["3/2", "0/2", "2", "a/b"])
def test_a_malformed_shard_is_a_usage_error(capsys, shard):
    with pytest.raises(SystemExit) as exc:
        main(["soak", "--random", "--seed", "1", "--shard", shard])
    assert exc.value.code == 2
    assert "argument --shard: must be i/N with 1 <= i <= N" in capsys.readouterr().err


def test_a_fixed_run_uses_the_profile_itself_and_no_seed():
    cmd = soak.build_command(soak.Trainer(adapter=REF), profile="quick", workers="0", python="PY")
    assert cmd == ["PY", "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
                   f"--conformance-adapter={REF}", "--hypothesis-profile=conformance-quick"]


def test_the_command_options_are_the_suites_own():
    """Every option the soak passes is one pytest (with the plugin and the soak's -p) accepts."""
    from conformance.options import OPTIONS
    flags = {flag for flag, _ in OPTIONS.values()}
    cmd = soak.build_command(soak.Trainer(adapter=REF), profile="conformance-ci", seed=1, world_size="2", workers="2",
                             report_dir=Path("r"), basetemp=Path("t"), select="test_x")
    ours = {arg.split("=")[0] for arg in cmd if arg.startswith("--") and arg.split("=")[0] in flags}
    assert ours == {"--conformance-adapter", "--conformance-world-size", "--conformance-report"}


def test_the_random_variants_are_registered_undecided_by_the_suites_fixed_seeds():
    from hypothesis import settings
    for name in PROFILES:
        variant = settings.get_profile(name + soak.RANDOM_SUFFIX)
        base = settings.get_profile(name)
        assert variant.derandomize is False and variant.database is None
        assert (variant.max_examples, variant.phases, variant.deadline) == (base.max_examples, base.phases, base.deadline)
        assert name + soak.RANDOM_SUFFIX not in SEEDED_PROFILES   # so the suite does not pin its seed


DRAWS_TEST = """
import os
from hypothesis import given, strategies as st
from conformance.suite import _profile_seed

@_profile_seed
@given(st.integers(0, 10 ** 9))
def test_draw(x):
    with open(os.environ["DRAWS"], "a") as f:
        f.write(f"{x}\\n")
"""


@pytest.mark.slow
def test_a_seed_decides_the_draws_under_a_random_variant_and_not_under_the_fixed_profile(tmp_path, monkeypatch):
    """The suite's own fixed-seed decorator: `ci` ignores --hypothesis-seed, `ci-random` obeys it."""
    import subprocess
    (tmp_path / "test_draws.py").write_text(DRAWS_TEST)

    def draws(profile: str, seed: int) -> list[str]:
        out = tmp_path / f"draws-{profile}-{seed}-{len(list(tmp_path.glob('draws-*')))}.txt"
        env = {**os.environ, "DRAWS": str(out)}
        env.pop("PYTEST_XDIST_WORKER", None)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", soak.PLUGIN,
                               f"--hypothesis-profile={profile}", f"--hypothesis-seed={seed}", "test_draws.py"],
                              check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return out.read_text().split()

    assert draws("ci", 1) == draws("ci", 2)   # the gate: the suite's fixed seed wins
    first = draws("conformance-ci-random", 1)
    assert len(first) == 8 and first == draws("conformance-ci-random", 1) != draws("conformance-ci-random", 2)


# -- the campaign: lines, table, replays and burners ----------------------------------------------

def test_each_run_line_the_table_and_each_failure_carry_the_seed_and_a_replay(tmp_path):
    plan = planned("--adapter", REF, "--trainer-cmd", "python train.py", "--random", "--seed", "7", "--runs", "2",
                   "--workers", "0", tmp_path=tmp_path)
    seen = []

    def fake_run(cmd, run_dir):
        seen.append((cmd, run_dir))
        if "--conformance-trainer-cmd=python train.py" in cmd and "--hypothesis-seed=" + str(soak.run_seed(7, 2)) in cmd:
            return soak.Outcome({"failed": 1, "passed": 3}, [("no_lost_work[inside_save]", "lost step 7\nmore")])
        return soak.Outcome({"passed": 4}, [])

    lines = []
    assert soak.campaign(plan, run=fake_run, out=lambda *a, **k: lines.append(" ".join(map(str, a)))) == 1
    text = "\n".join(lines)
    assert len(seen) == 4 and len({d for _, d in seen}) == 4
    s1, s2 = soak.run_seed(7, 1), soak.run_seed(7, 2)
    assert f"{REF} run 1/2 seed {s1}: 0 failure(s), 4 passed" in text
    assert f"cmd:python train.py run 2/2 seed {s2}: 1 failure(s), 1 failed, 3 passed" in text
    assert "campaign seed 7 (--random --seed 7 replays it)" in text
    table = text[text.index("trainer  "):]
    assert all(str(s) in table for s in (s1, s2))
    fail = next(line for line in lines if line.startswith("  FAIL "))
    assert fail == f"  FAIL cmd:python train.py run 2: no_lost_work[inside_save]: lost step 7 (seed {s2})"
    replay = lines[lines.index(fail) + 1]
    assert replay.startswith("    replay: ")
    argv = shlex.split(replay[len("    replay: "):])
    assert argv == soak.build_command(soak.Trainer(trainer_cmd="python train.py"), profile="ci", seed=s2,
                                      workers="0", select="test_no_lost_work")
    assert "1 run(s) with failures" in text


def test_a_run_without_a_report_is_a_failure_with_a_replay_of_the_whole_run(tmp_path):
    plan = planned("--adapter", REF, "--runs", "1", "--workers", "0", "--profile", "quick", tmp_path=tmp_path)
    lines = []
    code = soak.campaign(plan, run=lambda cmd, d: soak.Outcome({}, [("(no report)", "pytest exited 4: boom")]),
                         out=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert code == 1
    assert f"  FAIL {REF} run 1: (no report): pytest exited 4: boom (seed 0 (fixed))" in lines
    replay = shlex.split(next(line for line in lines if line.startswith("    replay: "))[len("    replay: "):])
    assert "-k" not in replay and f"--conformance-adapter={REF}" in replay and "--hypothesis-profile=conformance-quick" in replay


def test_failures_settled_by_repetition_are_counted_per_run_and_in_all(tmp_path):
    """A run's report says how its failures were settled (suite._confirmed): each failure's line names
    its verdict, the run's line counts them, and the campaign ends with the totals."""
    from conformance.model import evidence
    from conformance.report import report
    raced = evidence.Intermittent("all_or_nothing", "save:9/7@r1", (True, False), (False, True))
    once = evidence.Intermittent("no_torn_state", "", (True, False), (False,))
    split = evidence.RunnerDisagreement("interrupt", "", "[interrupt] warm only", "passed the same case 4 of 4 times")
    cases = [report.Case("all_or_nothing", "t::a", "failed", message="[all_or_nothing] torn", evidence=[raced]),
             report.Case("no_torn_state", "t::b", "failed", message="[no_torn_state] torn", evidence=[once]),
             report.Case("interrupt", "t::c", "passed", evidence=[split])]
    report.write_report(report.Report({}, None, None, "", "", cases), tmp_path / "run")
    outcome = soak.run_pytest([sys.executable, "-c", "pass"], tmp_path / "run")
    assert outcome.settled == [raced, once] and outcome.disagreements == 1
    plan = planned("--adapter", REF, "--runs", "1", "--workers", "0", tmp_path=tmp_path)
    lines = []
    assert soak.campaign(plan, run=lambda cmd, d: outcome, out=lambda *a, **k: lines.append(" ".join(map(str, a)))) == 1
    text = "\n".join(lines)
    assert (f"{REF} run 1/1 seed 0 (fixed): 3 failure(s) (1 intermittent, 1 not reproducible, 1 runner "
            "disagreement(s)), 2 failed, 1 passed") in text, text
    assert (f"  FAIL {REF} run 1: all_or_nothing: [all_or_nothing] torn (seed 0 (fixed)); INTERMITTENT: all_or_nothing "
            "(save:9/7@r1) failed 2 of 4 runs of the case") in text, text
    assert "soak: failures settled by repetition: 1 intermittent, 1 not reproducible; 1 runner disagreement(s)" in text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _record_burners(monkeypatch) -> list:
    """The burner processes soak starts, as it starts them."""
    started = []
    real = Burners.__enter__

    def enter(self):
        out = real(self)
        started.extend(self.procs)
        return out
    monkeypatch.setattr(Burners, "__enter__", enter)
    return started


def _burning_plan(tmp_path, load=2):
    return planned("--adapter", REF, "--runs", "2", "--load", str(load), "--workers", "0", tmp_path=tmp_path)


def test_the_burners_run_beside_every_run_and_are_stopped_after(tmp_path, monkeypatch):
    started = _record_burners(monkeypatch)
    during = []

    def fake_run(cmd, run_dir):
        during.append([p.poll() is None and _alive(p.pid) for p in started])
        return soak.Outcome({"passed": 1}, [])

    lines = []
    assert soak.campaign(_burning_plan(tmp_path), run=fake_run, out=lambda *a, **k: lines.append(" ".join(a))) == 0
    assert during == [[True, True], [True, True]]
    assert len(started) == 2 and not any(_alive(p.pid) for p in started)
    assert lines[0].startswith("soak: 2 run(s) x 1 trainer(s)") and "2 burner(s); at start: load average" in lines[0]
    assert any(line.startswith("soak: at end: load average") for line in lines)


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyboardInterrupt()])
def test_the_burners_are_stopped_on_an_exception_and_on_ctrl_c(tmp_path, monkeypatch, error):
    started = _record_burners(monkeypatch)

    def fake_run(cmd, run_dir):
        assert all(_alive(p.pid) for p in started)
        raise error

    with pytest.raises(type(error)):
        soak.campaign(_burning_plan(tmp_path, load=1), run=fake_run, out=lambda *a, **k: None)
    assert len(started) == 1 and not _alive(started[0].pid)


def test_a_burner_ends_by_itself_when_soak_dies(tmp_path):
    """A SIGKILLed soak runs no cleanup: its burners notice the new parent and exit."""
    import subprocess
    import time
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from conformance.cli.load import BURNER\n"
        "import os\n"
        "p = subprocess.Popen([sys.executable, '-S', '-c', BURNER, str(os.getpid())])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        burner = int(pid_file.read_text())
        assert _alive(burner)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(burner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(burner)
