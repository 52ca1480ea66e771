"""Campaigns over many machines: `report --merge` (sums, deduplicated failures, levels and badge,
refusals), the shared Hypothesis example database (CONFORMANCE_EXAMPLE_DB, no network), and the
examples/ GitHub Actions workflow and Kubernetes Indexed Job, parsed and run here with 2 shards."""
from __future__ import annotations

import datetime as _dt
import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conformance.__main__ import build_parser, main
from conformance.checks.registry import LEVELS, level_ids
from conformance.model import settings as suite_settings
from conformance.model.evidence import Trial
from conformance.report import merge, report

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "examples" / "conformance-campaign.yml"
K8S = REPO / "examples" / "conformance-campaign-k8s.yaml"
ADAPTER = report.AdapterInfo("reference_trainer", "resume_conformance.fixtures.reference_trainer:ADAPTER", "", ("syscall_crash",))
L1 = level_ids(LEVELS[0][2])


def _case(check: str, outcome: str = "passed", schedule: str | None = None, message: str = "") -> report.Case:
    evidence = [Trial(check=check, schedule=schedule, spec="s", crashes=(), final_exit=0, steps_compared=4,
                      max_abs_diff=0.5, tolerance=1e-4)] if schedule else []
    if outcome == "failed" and not message:
        message = f"[{check}] lost steps\n  trainer:  t\n  schedule: {schedule}\n  replay:   python -m conformance replay"
    return report.Case(check, f"conformance::{check}", outcome, message=message, evidence=evidence, adapter=ADAPTER)


def _write(directory: Path, cases: list[report.Case], *, adapter=ADAPTER, profile="ci-random",
           suite=None) -> Path:
    built = report.environment(adapter, profile, cases, header="conformance: trainer reference_trainer")
    if suite is not None:
        built.versions["suite"] = suite
    return report.write_report(built, directory)[0]


# -- merging --------------------------------------------------------------------------------------

def test_merged_counts_are_the_sum_of_the_shards_and_the_merged_json_reads_back(tmp_path):
    a = _write(tmp_path / "a", [_case("determinism_precondition"), _case("preemption"),
                                _case("interrupt", "skipped")])
    b = _write(tmp_path / "b", [_case("determinism_precondition"), _case("preemption", "failed", "fs:3")])
    merged = merge.merge_files([tmp_path / "a", b])
    assert merged.counts == {"passed": 3, "skipped": 1, "failed": 1}
    assert [s.path for s in merged.sources] == [str(a), str(b)]
    assert [s.counts for s in merged.sources] == [{"passed": 2, "skipped": 1}, {"passed": 1, "failed": 1}]
    written = merge.write(merged, tmp_path / "out")
    again = report.load_report(written.report)
    assert again.counts == merged.counts and again.sources == merged.sources
    assert json.loads(written.report.read_text())["counts"] == {"passed": 3, "skipped": 1, "failed": 1}
    # a merged report joins again: its shards stay the sources, the counts keep adding up
    c = _write(tmp_path / "c", [_case("interrupt")])
    twice = merge.merge_files([written.report, c])
    assert twice.counts == {"passed": 4, "skipped": 1, "failed": 1} and len(twice.sources) == 3


def test_a_failure_several_shards_found_is_listed_once_per_check_and_schedule(tmp_path):
    same = _case("no_lost_work[inside_save]", "failed", "save:6/3")
    shards = [_write(tmp_path / "1", [same, _case("preemption")]),
              _write(tmp_path / "2", [_case("no_lost_work[inside_save]", "failed", "save:6/3")]),
              _write(tmp_path / "3", [_case("no_lost_work[inside_save]", "failed", "fs:9")])]
    merged = merge.merge_files(shards)
    assert merged.counts == {"failed": 3, "passed": 1}     # counts are cases: every shard's failure counts
    assert [c.failure for c in merged.failed] == [("no_lost_work[inside_save]", "schedule: save:6/3"),
                                                  ("no_lost_work[inside_save]", "schedule: fs:9")]
    md = report.render_markdown(merged)
    assert md.count("### `no_lost_work[inside_save]`") == 2
    assert "### `no_lost_work[inside_save]` (found 2 times)" in md
    assert "| `no_lost_work[inside_save]` | **FAIL** ×3 |" in md and "| `preemption` | pass |" in md


def test_a_failure_without_a_schedule_is_known_by_its_replay_line_else_by_its_message():
    replay = _case("corruption_detected[bitflip]", "failed", message="[c] loaded bad data\n  replay:   python -m x --a=1")
    assert replay.failure == ("corruption_detected[bitflip]", "replay:   python -m x --a=1")
    bare = _case("hang", "error", message="RuntimeError: boom")
    assert bare.failure == ("hang", "RuntimeError: boom")
    merged = report.Report({}, ADAPTER, "ci", "", "", [bare, _case("hang", "error", message="RuntimeError: other")])
    assert len(merged.failed) == 2


def _l1(outcome_of=lambda check: "passed") -> list[report.Case]:
    return [_case(check, outcome_of(check), "fs:1" if outcome_of(check) == "failed" else None) for check in L1]


def test_the_merged_level_needs_every_check_passed_wherever_it_ran(tmp_path):
    both = merge.merge_files([_write(tmp_path / "a", _l1()), _write(tmp_path / "b", _l1())])
    assert [(s.level, s.status) for s in both.levels()][0] == ("L1", "met")
    skipped_once = merge.merge_files([_write(tmp_path / "c", _l1()), _write(tmp_path / "d", _l1(
        lambda check: "skipped" if check == "crash_states" else "passed"))])
    assert skipped_once.levels()[0].status == "met"      # it ran, and passed, on the other machine
    one_fails = merge.merge_files([_write(tmp_path / "e", _l1()), _write(tmp_path / "f", _l1(
        lambda check: "failed" if check == "no_torn_state" else "passed"))])
    assert one_fails.levels()[0].status == "not met" and one_fails.levels()[0].missing == ("no_torn_state",)
    written = merge.write(both, tmp_path / "out")
    assert "L1 process-crash safe" in written.badge.read_text()
    assert json.loads(written.report.read_text())["level"] == "L1"
    assert "**Conformance level: L1 (process-crash safe)**" in written.summary.read_text()
    assert "no level met" in merge.write(one_fails, tmp_path / "out2").badge.read_text()


def test_a_soak_directory_means_the_report_of_each_of_its_runs(tmp_path):
    for run in ("t1-x-run1", "t1-x-run2"):
        _write(tmp_path / "shard" / run, [_case("preemption")])
    (tmp_path / "shard" / "t1-x-run1" / "tmp").mkdir()           # soak's scratch beside a report
    assert merge.report_files([tmp_path / "shard"]) == [tmp_path / "shard" / r / "report.json"
                                                        for r in ("t1-x-run1", "t1-x-run2")]
    assert merge.merge_files([tmp_path / "shard"]).counts == {"passed": 2}


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[Path], type, Path, str]]:
    """name -> (inputs, error type, the file it must name, words of the problem)."""
    good = _write(tmp_path / "good", [_case("preemption")])
    (tmp_path / "notjson.json").write_text("{nope")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "conformance-report/1", "cases": []}))
    other = _write(tmp_path / "other", [_case("preemption")], adapter=report.AdapterInfo(
        "chain", "resume_conformance.fixtures.chain:A", "", ()))
    newer = _write(tmp_path / "newer", [_case("preemption")], suite="9.9.9")
    fuzz = _write(tmp_path / "fuzz", [_case("preemption")], profile="fuzz-random")
    for run in ("t1-x-run1", "t1-x-run2"):
        (tmp_path / "soak" / run / "tmp").mkdir(parents=True)
    _write(tmp_path / "soak" / "t1-x-run1", [_case("preemption")])
    (tmp_path / "empty").mkdir()
    return {
        "missing": ([good, tmp_path / "nope.json"], merge.UnreadableReport, tmp_path / "nope.json", "no such file"),
        "not json": ([good, tmp_path / "notjson.json"], merge.UnreadableReport, tmp_path / "notjson.json",
                     "not a JSON report"),
        "old schema": ([good, old], merge.UnreadableReport, old, "schema 'conformance-report/1'"),
        "other trainer": ([good, other], merge.IncompatibleReport, other, "tests trainer `chain`"),
        "other suite": ([good, newer], merge.IncompatibleReport, newer, "suite version 9.9.9"),
        "other profile": ([good, fuzz], merge.IncompatibleReport, fuzz, "'fuzz-random'"),
        "given twice": ([tmp_path / "good", good], merge.MergeError, good, "given twice"),
        "run without report": ([good, tmp_path / "soak"], merge.UnreadableReport, tmp_path / "soak" / "t1-x-run2",
                               "wrote no report"),
        "empty directory": ([tmp_path / "empty"], merge.UnreadableReport, tmp_path / "empty", "holds no report.json"),
    }


@pytest.mark.parametrize("name", ["missing", "not json", "old schema", "other trainer", "other suite", "other profile",
                                  "given twice", "run without report", "empty directory"])
def test_what_is_not_one_campaign_is_refused_naming_the_file_and_the_problem(tmp_path, capsys, name):
    inputs, error, path, words = _bad_inputs(tmp_path)[name]
    with pytest.raises(error) as info:
        merge.merge_files(inputs)
    assert info.value.path == path and words in info.value.problem and info.value.fix
    assert main(["report", "--merge", *map(str, inputs), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and words in err and "\n  fix: " in err and "Traceback" not in err
    assert not (tmp_path / "merged").exists()


def test_the_command_writes_the_files_of_one_run_and_the_badge_and_exits_1_on_failures(tmp_path, capsys):
    a = _write(tmp_path / "a", [_case("preemption")])
    b = _write(tmp_path / "b", [_case("interrupt", "failed", "step:4")])
    assert main(["report", "--merge", str(tmp_path / "a"), str(b), "--out", str(tmp_path / "m")]) == 1
    out = capsys.readouterr().out
    assert f"  {a}: 1 passed\n  {b}: 1 failed\nmerged 2 report(s): 1 failed, 1 passed; 1 distinct failure(s)" in out
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["conformance-badge.svg", "report.json", "summary.md"]
    assert main(["report", str(tmp_path / "m" / "report.json")]) == 1      # the usual commands read it
    assert capsys.readouterr().out.startswith("## Resume conformance: FAILED")
    assert main(["report", "--merge", str(a), "--out", str(tmp_path / "m1")]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--merge", "a"], "give it --out DIR"),
    (["x.json", "--merge", "a", "--out", "d"], "x.json is given before --merge"),
    (["--merge", "a", "--out", "d", "--format", "json"], "--format is for rendering one report"),
    ([], "name a report.json to render, or --merge"),
])
def test_merge_usage_mistakes_are_usage_errors(capsys, argv, words):
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "\n  fix: " in err


# -- the shared example database ------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (None, "DirectoryBasedExampleDatabase(PosixPath('.hypothesis/examples'))"),
    ("", "DirectoryBasedExampleDatabase(PosixPath('.hypothesis/examples'))"),
    ("dir:/mnt/shared/hyp", "DirectoryBasedExampleDatabase(PosixPath('/mnt/shared/hyp'))"),
    ("github:acme/trainer", "MultiplexedDatabase(DirectoryBasedExampleDatabase(PosixPath('.hypothesis/examples')), "
     "ReadOnlyDatabase(GitHubArtifactDatabase(owner='acme', repo='trainer', artifact_name='hypothesis-example-db')))"),
    ("github:acme/trainer.py:nightly-db", "MultiplexedDatabase(DirectoryBasedExampleDatabase(PosixPath("
     "'.hypothesis/examples')), ReadOnlyDatabase(GitHubArtifactDatabase(owner='acme', repo='trainer.py', "
     "artifact_name='nightly-db')))"),
])
def test_the_example_database_setting(value, expected):
    assert repr(suite_settings.example_database(value)) == expected


@pytest.mark.parametrize("value, words", [
    ("nope", "expected dir:PATH or github:OWNER/REPO[:ARTIFACT]"),
    ("s3://bucket/x", "expected dir:PATH or github:OWNER/REPO[:ARTIFACT]"),
    ("dir:", "names no directory after 'dir:'"),
    ("github:acme", "expected github:OWNER/REPO or github:OWNER/REPO:ARTIFACT"),
    ("github:acme/trainer:a/b", "expected github:OWNER/REPO or github:OWNER/REPO:ARTIFACT"),
    ("github:-acme/trainer", "expected github:OWNER/REPO"),
])
def test_a_bad_example_database_setting_names_the_variable_and_the_problem(value, words):
    with pytest.raises(suite_settings.ExampleDbError) as info:
        suite_settings.example_database(value)
    assert str(info.value).startswith(f"CONFORMANCE_EXAMPLE_DB={value!r}") and words in str(info.value)
    assert "\n  fix: CONFORMANCE_EXAMPLE_DB=dir:" in str(info.value)


def test_a_file_is_not_a_shared_directory(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(suite_settings.ExampleDbError, match="exists and is not a directory"):
        suite_settings.example_database(f"dir:{tmp_path / 'f'}")


@pytest.fixture
def no_network(monkeypatch):
    """GitHub is never contacted: each request the artifact database would send is recorded and
    answered as offline (None, which Hypothesis takes for an unreachable GitHub)."""
    from hypothesis.database import GitHubArtifactDatabase
    asked: list[str] = []
    monkeypatch.setattr(GitHubArtifactDatabase, "_get_bytes", lambda self, url: asked.append(url))
    return asked


def test_the_github_setting_reads_the_nightlys_artifact_and_writes_locally(tmp_path, monkeypatch, no_network):
    from hypothesis.database import DirectoryBasedExampleDatabase, _hash
    monkeypatch.chdir(tmp_path)
    db = suite_settings.example_database("github:acme/trainer")
    # the artifact as Hypothesis caches the newest download: <its time>.zip of <hash(key)>/<hash(value)>
    cache = tmp_path / ".hypothesis" / "github-artifacts" / "hypothesis-example-db"
    cache.mkdir(parents=True)
    stamp = _dt.datetime.now(_dt.UTC).isoformat().replace(":", "_")
    with zipfile.ZipFile(cache / f"{stamp}.zip", "w") as zf:
        zf.writestr(zipfile.ZipInfo(_hash(b"check") + "/"), "")
        zf.writestr(f"{_hash(b'check')}/{_hash(b'from nightly')}", b"from nightly")
    assert list(db.fetch(b"check")) == [b"from nightly"]
    db.save(b"check", b"found here")
    assert list(DirectoryBasedExampleDatabase(".hypothesis/examples").fetch(b"check")) == [b"found here"]
    assert sorted(db.fetch(b"check")) == [b"found here", b"from nightly"]
    with zipfile.ZipFile(next(cache.glob("*.zip"))) as zf:
        assert len(zf.namelist()) == 2                      # the artifact is only read
    assert no_network == []


def test_without_the_artifact_the_local_database_still_serves(tmp_path, monkeypatch, no_network):
    from hypothesis.errors import HypothesisWarning
    monkeypatch.chdir(tmp_path)
    db = suite_settings.example_database("github:acme/trainer:nightly-db")
    db.save(b"k", b"v")
    with pytest.warns(HypothesisWarning, match="Disabling database"):
        assert list(db.fetch(b"k")) == [b"v"]
    assert no_network == ["https://api.github.com/repos/acme/trainer/actions/artifacts"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return {**env, **extra}


def test_the_profiles_use_the_database_the_variable_names(tmp_path):
    code = ("from hypothesis import settings\nimport conformance.model.settings\n"
            "print(repr(settings.get_profile('conformance-ci').database) == "
            "repr(settings.get_profile('conformance-fuzz').database))\n"
            "print(repr(settings.get_profile('conformance-ci').database))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=_env(CONFORMANCE_EXAMPLE_DB=f"dir:{tmp_path / 'shared'}"))
    assert proc.stdout.split("\n")[:2] == ["True", f"DirectoryBasedExampleDatabase(PosixPath('{tmp_path / 'shared'}'))"], \
        proc.stderr[-2000:]


def test_a_bad_setting_stops_the_suite_before_any_test_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider",
                           "--collect-only", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=_env(CONFORMANCE_EXAMPLE_DB="github:acme"))
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ERROR: CONFORMANCE_EXAMPLE_DB='github:acme': expected github:OWNER/REPO" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_soak_refuses_a_bad_setting_before_any_run(tmp_path, capsys, monkeypatch):
    from conformance.cli import soak
    monkeypatch.setattr(soak, "EXAMPLE_DB_PROBLEM", "CONFORMANCE_EXAMPLE_DB='x': expected dir:PATH")
    monkeypatch.setattr(soak, "run_pytest", lambda cmd, run_dir: pytest.fail(f"a run started: {cmd}"))
    assert main(["soak", "--adapter", ADAPTER.spec, "--out", str(tmp_path)]) == 2
    assert "python -m conformance soak: error: CONFORMANCE_EXAMPLE_DB='x'" in capsys.readouterr().err


# -- the examples: parsed -------------------------------------------------------------------------
def _yaml():
    return pytest.importorskip("yaml", reason="needs PyYAML (the 'test' extra's accelerate installs it)")


def _expand(text: str, values: dict[str, str]) -> str:
    """GitHub Actions `${{ expression }}`s replaced; one not in `values` fails the test."""
    def one(m):
        assert m.group(1) in values, f"an expression this test does not know: {m.group(0)}"
        return values[m.group(1)]
    return re.sub(r"\$\{\{\s*(.+?)\s*\}\}", one, str(text))


def _workflow() -> dict:
    return _yaml().safe_load(WORKFLOW.read_text())


def _step(job: dict, id_: str) -> dict:
    return next(s for s in job["steps"] if s.get("id") == id_)


def _argv_of(script: str, env: dict[str, str], cwd: Path) -> list[list[str]]:
    """The argv of each `python -m conformance ...` the script runs, as bash expands it (python stubbed)."""
    record = cwd / "argv.jsonl"
    stub = ('python() { "' + sys.executable + '" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" '
            f'>> "{record}"; }}\n')
    cwd.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", "-c", stub + script], cwd=cwd, env=_env(**env), check=False, timeout=120)
    return [json.loads(line) for line in record.read_text().splitlines()]


def _values(seed: str, shard: int, shards: int) -> dict[str, str]:
    return {"inputs.seed || github.run_id": seed, "github.run_id": seed, "matrix.shard": str(shard),
            "strategy.job-total": str(shards)}


def _workflow_env(values: dict[str, str], step: dict | None = None, **overrides: str) -> dict[str, str]:
    env = {k: _expand(v, values) for k, v in _workflow()["env"].items()}
    env.update({k: _expand(v, values) for k, v in (step or {}).get("env", {}).items()})
    return {**env, **overrides}


def _soak_plans(argvs: list[list[str]]):
    parsed = [build_parser().parse_args(argv[2:]) for argv in argvs]
    assert all(argv[:2] == ["-m", "conformance"] and p.command == "soak" and p.random for argv, p in zip(argvs, parsed))
    return parsed


def test_the_workflow_runs_one_campaign_over_its_matrix_and_merges_every_shard(tmp_path):
    doc = _workflow()
    assert set(doc[True]) == {"schedule", "workflow_dispatch"}            # `on:` (YAML 1.1 reads it as True)
    shards = doc["jobs"]["shard"]["strategy"]["matrix"]["shard"]
    n = len(shards)
    assert shards == list(range(1, n + 1)) and n >= 2
    soak_step = _step(doc["jobs"]["shard"], "soak")
    parsed = _soak_plans([argv for i in shards for argv in _argv_of(
        soak_step["run"], _workflow_env(_values("777", i, n), soak_step), tmp_path / f"m{i}")])
    assert {p.seed for p in parsed} == {777}                               # the same campaign seed everywhere
    assert sorted(p.shard for p in parsed) == [(i, n) for i in shards]     # N = the matrix size, each shard once
    assert {p.trainers[0].adapter for p in parsed} == {"resume_conformance.fixtures.reference_trainer:ADAPTER"}
    upload = next(s for s in doc["jobs"]["shard"]["steps"] if "upload-artifact" in s.get("uses", ""))
    assert upload["if"] == "always()" and all(line.startswith(f"{parsed[0].out}/")
                                              for line in upload["with"]["path"].split())
    merge_job = doc["jobs"]["merge"]
    assert merge_job["needs"] == "shard" and merge_job["if"] == "always()"
    download = next(s for s in merge_job["steps"] if "download-artifact" in s.get("uses", ""))
    names = [_expand(upload["with"]["name"], _values("777", i, n)) for i in shards]
    assert all(fnmatch.fnmatch(name, download["with"]["pattern"]) for name in names)
    merged = build_parser().parse_args(_step(merge_job, "merge")["run"].split()[3:])
    assert merged.merge == [f"{download['with']['path']}/*"] and merged.out


def _k8s() -> tuple[dict, dict, dict]:
    claim, shards, merge_job = _yaml().safe_load_all(K8S.read_text())
    return claim, shards, merge_job


def _container(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _container_env(job: dict, **overrides: str) -> dict[str, str]:
    return {**{e["name"]: e["value"] for e in _container(job)["env"]}, **overrides}


def test_the_indexed_job_runs_one_shard_per_completion_index_and_the_merge_reads_them(tmp_path):
    claim, shards, merge_job = _k8s()
    spec = shards["spec"]
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == n >= 2
    env = _container_env(shards)
    assert env["SHARDS"] == str(n)
    argvs = [argv for k in range(n) for argv in _argv_of(
        _container(shards)["args"][0], {**env, "JOB_COMPLETION_INDEX": str(k), "SCRATCH": str(tmp_path / f"s{k}"),
                                        "REPORTS": str(tmp_path / "reports")}, tmp_path / f"node{k}")]
    parsed = _soak_plans(argvs)
    assert {p.seed for p in parsed} == {int(env["CAMPAIGN_SEED"])}
    assert sorted(p.shard for p in parsed) == [(i, n) for i in range(1, n + 1)]
    assert _container_env(merge_job)["CAMPAIGN_SEED"] == env["CAMPAIGN_SEED"]
    claims = {v["persistentVolumeClaim"]["claimName"] for job in (shards, merge_job)
              for v in job["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {claim["metadata"]["name"]}
    assert [d["metadata"]["labels"]["step"] for d in (claim, shards, merge_job)] == ["shards", "shards", "merge"]
    (merged,) = _argv_of(_container(merge_job)["args"][0], _container_env(merge_job, REPORTS=str(tmp_path / "vol")),
                         tmp_path / "merge")
    assert merged[:4] == ["-m", "conformance", "report", "--merge"]
    assert merged[4:] == [f"{tmp_path}/vol/campaign-{env['CAMPAIGN_SEED']}/shard-*", "--out",
                          f"{tmp_path}/vol/campaign-{env['CAMPAIGN_SEED']}/merged"]


# -- the examples: run here, 2 shards -------------------------------------------------------------
TINY = {"PROFILE": "quick", "RUNS": "1", "SELECT": "determinism_precondition or restart_after_finish"}


ACTIONS_SHELL = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]   # how a `run:` step runs


def _bash(script: str, env: dict[str, str], cwd: Path, shell=ACTIONS_SHELL) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*shell, script], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _upload(patterns: list[str], cwd: Path, artifact: Path) -> None:
    """actions/upload-artifact: the matched files, relative to the least common ancestor of the patterns'
    directories before their first wildcard."""
    roots = []
    for pattern in patterns:
        parts = Path(pattern).parts
        fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        roots.append(Path(*parts[:fixed]))
    root = Path(os.path.commonpath(roots))
    for pattern in patterns:
        for found in glob.glob(pattern, root_dir=cwd):
            for f in [Path(found)] if (cwd / found).is_file() else [p.relative_to(cwd) for p in (cwd / found).rglob("*")]:
                if (cwd / f).is_file():
                    (artifact / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(cwd / f, artifact / f.relative_to(root))


def _shard_counts(directory: Path) -> list[tuple[str, dict[str, int]]]:
    return [(str(p.relative_to(directory)), report.load_report(p).counts) for p in sorted(directory.rglob("report.json"))]


def _summed(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


@pytest.mark.slow
@pytest.mark.needs_strace
def test_the_workflows_commands_run_here_with_2_shards_and_merge_to_their_sum(tmp_path):
    doc = _workflow()
    seed, shards = "4242", [1, 2]
    soak_step = _step(doc["jobs"]["shard"], "soak")
    upload = next(s for s in doc["jobs"]["shard"]["steps"] if "upload-artifact" in s.get("uses", ""))
    merge_job = doc["jobs"]["merge"]
    download = next(s for s in merge_job["steps"] if "download-artifact" in s.get("uses", ""))
    seeds = []
    for i in shards:       # each shard on its own "machine" (directory), then its artifact as the merge job gets it
        values = _values(seed, i, len(shards))
        machine = tmp_path / f"machine-{i}"
        proc = _bash(soak_step["run"], _workflow_env(values, soak_step, **TINY), machine)
        seeds += re.findall(r"run 1/1 seed (\d+): 0 failure\(s\)", proc.stdout)
        _upload(_expand(upload["with"]["path"], values).split(), machine,
                tmp_path / "merge" / download["with"]["path"] / _expand(upload["with"]["name"], values))
    assert len(set(seeds)) == 2                       # the two shards drew different runs of one campaign
    counts = _shard_counts(tmp_path / "merge" / download["with"]["path"])
    assert len(counts) == 2 and all(sum(c.values()) >= 1 for _, c in counts)
    summary = tmp_path / "step-summary.md"
    env = _workflow_env(_values(seed, 0, len(shards)), GITHUB_STEP_SUMMARY=str(summary))
    proc = _bash(_step(merge_job, "merge")["run"], env, tmp_path / "merge")
    _bash(_step(merge_job, "summary")["run"], env, tmp_path / "merge")
    merged = report.load_report(tmp_path / "merge" / "merged-report" / "report.json")
    assert merged.counts == _summed(counts) and len(merged.sources) == 2, proc.stdout
    assert summary.read_text() == (tmp_path / "merge" / "merged-report" / "summary.md").read_text()
    assert (tmp_path / "merge" / "merged-report" / "conformance-badge.svg").is_file()
    print(f"\nshards: {counts}\nmerged: {merged.counts}\n{proc.stdout}")


@pytest.mark.slow
@pytest.mark.needs_strace
def test_the_indexed_jobs_commands_run_here_with_2_shards_and_merge_to_their_sum(tmp_path):
    _, shards, merge_job = _k8s()
    volume = tmp_path / "volume"
    for k in range(2):
        env = _container_env(shards, JOB_COMPLETION_INDEX=str(k), SHARDS="2", SCRATCH=str(tmp_path / f"node{k}"),
                             REPORTS=str(volume), **TINY)
        _bash(_container(shards)["args"][0], env, tmp_path / f"node{k}", shell=_container(shards)["command"])
    campaign = volume / f"campaign-{_container_env(shards)['CAMPAIGN_SEED']}"
    assert sorted(p.name for p in campaign.iterdir()) == ["shard-1", "shard-2"]
    assert not list(campaign.rglob("tmp"))            # only the reports reached the shared volume
    counts = _shard_counts(campaign)
    _bash(_container(merge_job)["args"][0], _container_env(merge_job, REPORTS=str(volume)), tmp_path / "merge",
          shell=_container(merge_job)["command"])
    merged = report.load_report(campaign / "merged" / "report.json")
    assert merged.counts == _summed(counts) and len(merged.sources) == 2
