"""Reports, plots, expected failures and the report/soak commands."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.checks.plots import plot_name, plot_resume
from conformance.model import evidence
from conformance.report import expected, report

REPO = Path(__file__).resolve().parents[1]


# -- expected-failures file -----------------------------------------------------------------------
def test_expected_failures_match_exact_ids_with_or_without_the_parameter(tmp_path):
    f = tmp_path / "xfail.txt"
    f.write_text("# comment\n\nresume_matches_baseline : RNG not saved yet  # JIRA-1\n"
                 "corruption_detected[bitflip]: hashes next quarter\nno_lost_work : both parameters\n")
    entries = expected.parse(f)
    assert [(e.check, e.reason, e.line) for e in entries] == [
        ("resume_matches_baseline", "RNG not saved yet", 3),
        ("corruption_detected[bitflip]", "hashes next quarter", 4), ("no_lost_work", "both parameters", 5)]
    assert expected.match(entries, "corruption_detected[bitflip]").line == 4
    assert expected.match(entries, "corruption_detected[truncate]") is None
    assert expected.match(entries, "no_lost_work[inside_save]").line == 5
    assert expected.match(entries, "no_lost_work[between_saves]").line == 5
    assert expected.match(entries, "no_torn_state") is None


@pytest.mark.parametrize("entry", ["resume_matches : substrings no longer match",
                                   "corruption_detected[bitflips] : unknown parameter",
                                   "no_such_check : typo"])
def test_expected_failures_unknown_id_names_file_line_and_the_known_ids(tmp_path, entry):
    f = tmp_path / "xfail.txt"
    f.write_text("# ok\n" + entry + "\n")
    with pytest.raises(expected.ExpectedFailuresError, match=rf"{f.name}:2: unknown check id") as info:
        expected.parse(f)
    assert "no_lost_work[inside_save]" in str(info.value) and "crash_states" in str(info.value)


@pytest.mark.parametrize("text", ["resume_matches_baseline\n", " : reason only\n", "check :\n"])
def test_expected_failures_malformed_line_names_file_and_line(tmp_path, text):
    f = tmp_path / "xfail.txt"
    f.write_text("# ok\n" + text)
    with pytest.raises(expected.ExpectedFailuresError, match=rf"{f.name}:2: expected '<check id> : <reason>'"):
        expected.parse(f)


def test_expected_failures_missing_file(tmp_path):
    with pytest.raises(expected.ExpectedFailuresError, match="nope.txt: cannot read"):
        expected.parse(tmp_path / "nope.txt")


# -- report rendering -----------------------------------------------------------------------------
def _sample_report() -> report.Report:
    cases = [
        report.Case("determinism_precondition", "n::a", "passed", evidence=[evidence.Determinism(
            spec="total_steps=14", exit_codes=(0, 0), steps=14, max_abs_diff=0.0, tolerance=1e-4, operations=40)]),
        report.Case("resume_matches_baseline", "n::b", "failed",
                    message="[resume_matches_baseline] final process: loss differs\n  replay:   "
                            "python -m conformance replay ...",
                    evidence=[evidence.Trial(check="resume_matches_baseline", schedule="step:10", spec="s",
                                             crashes=(), final_exit=0, steps_compared=4, max_abs_diff=0.39,
                                             tolerance=1e-4)], plots=["/x/p.png"]),
        report.Case("schema_migration", "n::c", "skipped", reason="adapter lacks capability 'legacy_samples'"),
    ]
    return report.environment(report.AdapterInfo("t", "m:A", "1.2", ()), "ci", cases)


def test_markdown_summary_has_verdict_table_and_failure_details():
    md = report.render_markdown(_sample_report())
    assert md.startswith("## Resume conformance: FAILED")
    assert "| `resume_matches_baseline` | **FAIL** | 1 trial(s), schedules step:10; max \\|loss diff\\| 0.39 |" in md
    assert "adapter lacks capability 'legacy_samples'" in md
    assert "### `resume_matches_baseline`" in md and "replay:   python -m conformance replay" in md
    assert "Plot: `/x/p.png`" in md and "version 1.2" in md and "profile `ci`" in md


def test_retention_whose_outcome_varies_is_a_warning_that_fails_nothing(tmp_path):
    varies = "run 1 kept the checkpoints of steps 6, 9, 12, 14; run 2 kept 9, 12, 14"
    case = report.Case("determinism_precondition", "n::a", "passed", evidence=[evidence.Determinism(
        spec="total_steps=14", exit_codes=(0, 0), steps=14, max_abs_diff=0.0, tolerance=0.0, retention_varies=varies)])
    found = report.environment(report.AdapterInfo("t", "m:A", "", ()), "ci", [case])
    assert not found.failed and found.warnings == [found.warnings[0]] and varies in found.warnings[0]
    assert f"**Warning**: retention's outcome varies between two uninterrupted runs (total_steps=14): {varies}" \
        in report.render_markdown(found)
    json_path, _ = report.write_report(found, tmp_path / "rep")
    assert json.loads(json_path.read_text())["warnings"] == found.warnings
    assert report.load_report(json_path).warnings == found.warnings
    assert "retention's outcome varies" in case.evidence[0].summary()


def test_report_command_renders_saved_report_and_exits_1_on_failures(tmp_path):
    json_path, _ = report.write_report(_sample_report(), tmp_path / "rep")
    proc = subprocess.run([sys.executable, "-m", "conformance", "report", str(json_path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == report.render_markdown(report.load_report(json_path))
    out = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "-m", "conformance", "report", str(json_path), "--format=json",
                           f"--out={out}"], capture_output=True, text=True, cwd=REPO)
    assert json.loads(out.read_text())["cases"] == json.loads(json_path.read_text())["cases"]


@pytest.mark.parametrize("content, problem", [(None, "no such report file"), ("{nope", "not a JSON report"),
                                              ('{"schema": "other/1", "cases": []}', "not a conformance report")])
def test_report_command_rejects_bad_input_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "conformance", "report", str(path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert str(path) in proc.stderr and problem in proc.stderr


def test_jsonable_keeps_json_strict():
    assert json.loads(json.dumps(evidence.jsonable({1: float("inf"), "t": (1, 2.5), "n": None}),
                                 allow_nan=False)) == {"1": "inf", "t": [1, 2.5], "n": None}


def test_evidence_round_trips_through_json_as_typed_records():
    for item in _sample_report().cases[1].evidence + [evidence.CrashStates(3, 2, 1, ("4t",)),
                                                       evidence.Trial("c", "fs:1", "s", (evidence.CrashRecord(
                                                           "fs:1", "write", 3, 0, 3),), 0, 3, float("inf"), 1e-4)]:
        again = evidence.Evidence.from_json(json.loads(json.dumps(item.to_json())))
        assert type(again) is type(item) and again.summary() == item.summary()
    trial = evidence.Evidence.from_json(json.loads(json.dumps(
        evidence.Trial("c", "fs:1", "s", (evidence.CrashRecord("fs:1", "w", 3, 0, 3),), 0, 3, None, 1e-4).to_json())))
    assert trial.crashes[0].resumed_from == 3


# -- plots ----------------------------------------------------------------------------------------
def test_plot_resume_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'plots' extra (matplotlib)")
    path = tmp_path / plot_name("resume_matches_baseline", "my trainer", None, "x=1")
    written = plot_resume(path, title="t", baseline={1: 1.0, 2: 0.5, 3: 0.4},
                          resumed=[("resumed", {2: 0.6, 3: 0.5})], crashes=[("step:1", 1.5)], resumes=[1])
    assert written == path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert " " not in path.name


def test_plot_without_matplotlib_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    msg = plot_resume(tmp_path / "p.png", title="t", baseline={1: 1.0}, resumed=[], crashes=[], resumes=[])
    assert isinstance(msg, str) and "matplotlib is not installed" in msg
    assert not (tmp_path / "p.png").exists()


# -- end to end: the plugin writes the report, junitxml still works ------------------------------
def _run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
         f"--basetemp={tmp_path / 'base'}", "--hypothesis-profile=conformance-quick", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.needs_strace
def test_failure_report_plot_and_junitxml(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'plots' extra (matplotlib)")
    rep, xml = tmp_path / "rep", tmp_path / "junit.xml"
    proc = _run_suite(tmp_path, "--adapter=resume_conformance.fixtures.broken.rng_not_restored:ADAPTER",
                      "-k", "resume_matches_baseline or determinism_precondition",
                      f"--conformance-report={rep}", f"--junitxml={xml}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = report.load_report(rep / "report.json")
    assert data.adapter.spec == "resume_conformance.fixtures.broken.rng_not_restored:ADAPTER"
    assert data.versions["suite"] and data.versions["torch"] and data.hypothesis_profile == "conformance-quick"
    cases = {c.check: c for c in data.cases}
    assert cases["determinism_precondition"].outcome == "passed"
    failed = cases["resume_matches_baseline"]
    assert failed.outcome == "failed"
    assert failed.message.startswith("[resume_matches_baseline]")
    trial = next(e for e in failed.evidence if isinstance(e, evidence.Trial) and e.mismatches)
    assert trial.max_abs_diff > 1e-4 and trial.crashes[0].resumed_from >= 0
    plot = Path(failed.plots[0])
    assert plot.parent == rep / "plots" and plot.read_bytes()[:4] == b"\x89PNG"
    assert f"plot:     {plot}" in failed.message
    assert "**FAIL**" in (rep / "summary.md").read_text()
    names = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert names["test_resume_matches_baseline"].find("failure") is not None
    assert f"plot:     {plot}" in names["test_resume_matches_baseline"].find("failure").get("message", "") + \
        (names["test_resume_matches_baseline"].find("failure").text or "")


@pytest.mark.slow
@pytest.mark.needs_strace
def test_expected_failures_file_xfails_and_is_strict(tmp_path):
    xfail = tmp_path / "expected.txt"
    xfail.write_text("resume_matches_baseline : RNG restore lands next sprint\n"
                     "determinism_precondition : wrongly listed: it passes\n")
    rep = tmp_path / "rep"
    proc = _run_suite(tmp_path, "--adapter=resume_conformance.fixtures.broken.rng_not_restored:ADAPTER",
                      "-k", "resume_matches_baseline or determinism", f"--expected-failures={xfail}",
                      f"--conformance-report={rep}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]            # the XPASS fails the gate
    assert "1 xfailed" in out and "1 failed" in out and "remove the entry" in out
    cases = {c.check: c for c in report.load_report(rep / "report.json").cases}
    assert cases["resume_matches_baseline"].outcome == "xfailed"
    assert "RNG restore lands next sprint" in cases["resume_matches_baseline"].reason
    lenient = _run_suite(tmp_path, "--adapter=resume_conformance.fixtures.broken.rng_not_restored:ADAPTER",
                         "-k", "resume_matches_baseline or determinism", f"--expected-failures={xfail}",
                         "--expected-failures-lenient")
    assert lenient.returncode == 0, (lenient.stdout + lenient.stderr)[-3000:]
    assert "1 xfailed, 1 xpassed" in lenient.stdout


def test_an_unknown_id_in_the_expected_failures_file_is_one_usage_error(tmp_path):
    xfail = tmp_path / "expected.txt"
    xfail.write_text("resume_matchs_baseline : typo\n")
    proc = _run_suite(tmp_path, f"--expected-failures={xfail}", "--collect-only")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert f"{xfail}:1: unknown check id 'resume_matchs_baseline'" in proc.stderr


@pytest.mark.slow
@pytest.mark.needs_strace
def test_soak_reports_failures_of_a_flaky_or_broken_trainer(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "conformance", "soak", "--runs", "1", "--profile", "quick",
                           "--workers", "0", "--adapter", "resume_conformance.fixtures.broken.clock_seeded_data_order:ADAPTER",
                           "--out", str(tmp_path / "soak")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 run(s) with failures" in proc.stdout
    assert ("FAIL resume_conformance.fixtures.broken.clock_seeded_data_order:ADAPTER run 1: "
            "determinism_precondition:") in proc.stdout


# -- the example CI gate --------------------------------------------------------------------------
EXAMPLES = REPO / "examples"


def test_the_workflow_template_uses_only_real_options():
    workflow = (REPO / "conformance" / "templates" / "checkpoint-conformance.yml").read_text()
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        doc = yaml.safe_load(workflow)
        steps = doc["jobs"]["conformance"]["steps"]
        assert any("actions/cache" in s.get("uses", "") and s["with"]["path"] == ".hypothesis/examples" for s in steps)
        assert any("upload-artifact" in s.get("uses", "") and s["with"]["path"] == "conformance-report/" for s in steps)
    help_text = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--help"],
                               capture_output=True, text=True, cwd=REPO).stdout
    used = {opt for opt in __import__("re").findall(r"(--[a-z][a-z-]+)=", workflow)}
    assert {"--adapter", "--hypothesis-profile", "--conformance-report", "--expected-failures",
            "--junitxml"} <= used
    known = help_text + " --junitxml"   # pytest lists it as --junit-xml, its alias
    missing = [opt for opt in used if opt not in known]
    assert not missing, f"the example workflow uses options pytest does not know: {missing}"
    assert expected.parse(EXAMPLES / "conformance-expected-failures.txt") == []


def test_a_flaky_failure_reports_the_failure_inside_it():
    """Hypothesis's FlakyFailure (a draw failed, its replay did something else) is a group: the
    report keeps the check's own message from inside it, not only the headline."""
    from hypothesis.errors import FlakyFailure

    from conformance.collect import failure_message
    try:
        pytest.fail("[io_error[enospc]] after ENOSPC the trainer exited 1\n  fault: ENOSPC injected", pytrace=False)
    except pytest.fail.Exception as exc:
        failed = exc
    group = FlakyFailure("Inconsistent results from replaying a test case!", [failed, ValueError("replayed: rejected")])
    text = failure_message(group)
    assert text.startswith("hypothesis.errors.FlakyFailure: Inconsistent results")
    assert "inner exception 1: [io_error[enospc]] after ENOSPC the trainer exited 1\n      fault: ENOSPC injected" in text
    assert "inner exception 2: ValueError: replayed: rejected" in text
    assert failure_message(AssertionError("plain")) == "plain" and failure_message(KeyError("k")) == "KeyError: 'k'"


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_kill_the_suite_could_not_land_draws_another_point_and_is_counted_not_failed(tmp_path):
    """Every other drawn kill of no_torn_state "does not land" (as a racing async writer's thread
    can make it): those draws are the suite's problem, so the check is decided on the others, passes
    for the correct trainer, and the report counts the undelivered draws with the reason."""
    (tmp_path / "conftest.py").write_text(
        "from conformance.checks.registry import Check\n"
        "from conformance.faults.delivery import CrashNotLanded\n"
        "_decide, _calls = Check.decide, []\n"
        "def decide(self, session, spec, param=None, case=None):\n"
        "    if self.id == 'no_torn_state':\n"
        "        _calls.append(case)\n"
        "        if len(_calls) % 2:\n"
        "            raise CrashNotLanded(f'crash point {case} was planned at write #3 but did not land there: test')\n"
        "    return _decide(self, session, spec, param, case)\n"
        "Check.decide = decide\n")
    rep = tmp_path / "rep"
    proc = _run_suite(tmp_path, "-k", "no_torn_state", "--hypothesis-profile=conformance-ci",
                      f"--conformance-report={rep}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out[-3000:]
    (case,) = [c for c in report.load_report(rep / "report.json").cases if c.check == "no_torn_state"]
    (draws,) = [e for e in case.evidence if isinstance(e, evidence.Draws)]
    assert draws.undelivered >= 1 and draws.delivered >= 1, draws
    assert "did not land there: test" in draws.reasons[0]
