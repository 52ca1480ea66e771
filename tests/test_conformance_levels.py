"""Conformance levels and the badge (from fixture reports), and `init` end to end."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance.checks import all_check_ids
from conformance.report import report
from conformance.report.levels import assess, badge_svg, highest


def _report(**outcomes: str) -> report.Report:
    """Every check passed, except those given (id -> outcome); ids not in the registry are left out."""
    cases = [report.Case(i, f"n::{i}", outcomes.get(i, "passed")) for i in all_check_ids()]
    return report.environment(None, "ci", [c for c in cases if c.outcome != "absent"])


def test_every_level_met_when_every_check_passed():
    levels = _report().levels()
    assert [(s.level, s.status) for s in levels] == [("L1", "met"), ("L2", "met"), ("L3", "met"), ("L4", "met")]
    assert highest(levels).level == "L4"


def test_a_single_process_trainer_reaches_l3_and_l4_is_not_tested():
    skipped = {i: "skipped" for i in all_check_ids() if i.startswith(("rank_resume", "all_or_nothing", "reshard"))}
    levels = _report(**skipped).levels()
    assert [(s.level, s.status) for s in levels] == [("L1", "met"), ("L2", "met"), ("L3", "met"), ("L4", "not tested")]
    assert highest(levels).level == "L3"


def test_a_skipped_l2_check_does_not_claim_l2():
    levels = _report(**{"power_loss[strict]": "skipped"}).levels()
    assert [s.status for s in levels[:3]] == ["met", "not tested", "met"]
    assert highest(levels).level == "L1"          # L3 passing does not skip over L2
    assert levels[1].missing == ("power_loss[strict]",)


@pytest.mark.parametrize("outcome", ["failed", "xfailed", "error"])
def test_a_failing_or_expected_failing_check_is_not_met(outcome):
    levels = _report(**{"no_lost_work[inside_save]": outcome}).levels()
    assert levels[0].status == "not met" and highest(levels) is None


def test_report_and_summary_state_the_level(tmp_path):
    built = _report(**{"io_error[eio]": "failed"})
    json_path, md_path = report.write_report(built, tmp_path)
    data = __import__("json").loads(json_path.read_text())
    assert data["level"] == "L2" and data["levels"][2]["status"] == "not met"
    assert "**Conformance level: L2 (power-loss durable)**" in md_path.read_text()
    assert report.load_report(json_path).levels()[1].status == "met"


def test_badge_command_writes_an_svg(tmp_path):
    json_path, _ = report.write_report(_report(**{"preemption": "skipped"}), tmp_path)
    out = tmp_path / "badge.svg"
    proc = subprocess.run([sys.executable, "-m", "conformance", "badge", str(json_path), f"--out={out}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text()
    assert svg.startswith("<svg") and "L2 power-loss durable" in svg and "resume conformance" in svg
    assert "L3 not tested" in proc.stdout
    assert "no level met" in badge_svg(assess({}))


@pytest.mark.slow
@pytest.mark.needs_strace
def test_init_writes_the_files_refuses_to_overwrite_and_the_first_run_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "conformance", "init", "--framework", "hf", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for name in ("conformance_adapter.py", ".github/workflows/checkpoint-conformance.yml",
                 "conformance-expected-failures.txt", "conformance-pytest.toml"):
        assert (tmp_path / name).is_file(), name
    assert "passed" in proc.stdout and "failed" not in proc.stdout.splitlines()[-1]
    assert "ADAPTER: conformance_adapter:ADAPTER" in (tmp_path / ".github/workflows/checkpoint-conformance.yml").read_text()
    compile((tmp_path / "conformance_adapter.py").read_text(), "conformance_adapter.py", "exec")
    (tmp_path / "conformance-expected-failures.txt").write_text("resume_matches_baseline : mine\n")
    again = subprocess.run([sys.executable, "-m", "conformance", "init", "--dir", str(tmp_path), "--no-run"],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert (tmp_path / "conformance-expected-failures.txt").read_text() == "resume_matches_baseline : mine\n"
    forced = subprocess.run([sys.executable, "-m", "conformance", "init", "--dir", str(tmp_path), "--no-run", "--force"],
                            capture_output=True, text=True)
    assert forced.returncode == 0 and "mine" not in (tmp_path / "conformance-expected-failures.txt").read_text()


@pytest.mark.parametrize("framework", ["plain", "lightning", "accelerate", "hf"])
def test_every_framework_template_compiles(framework):
    from conformance.cli.init import files
    compile(files(framework)["conformance_adapter.py"], "conformance_adapter.py", "exec")


def _gate_step(workflow: str) -> str:
    """The shell script of the workflow's "Run the gate" step, with GitHub's expressions filled in
    as on a pull request."""
    lines = workflow.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- name: Run the gate")
    body_at = next(i for i in range(start, len(lines)) if lines[i].strip() == "run: |") + 1
    indent = len(lines[body_at]) - len(lines[body_at].lstrip())
    body = []
    for line in lines[body_at:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        body.append(line[indent:])
    return "\n".join(body).replace("${{ github.event_name }}", "pull_request")


@pytest.mark.slow
@pytest.mark.needs_strace
def test_the_commands_the_generated_files_give_run_as_written(tmp_path):
    """The gate command in conformance-pytest.toml and the workflow's gate step, run as written in a
    project that merged the generated settings (the bundled adapter stands in for the team's)."""
    import os
    import re

    from conformance.cli.init import GATE, write
    write(tmp_path, "plain")
    (tmp_path / "conformance_adapter.py").write_text(
        "from resume_conformance.fixtures.python_adapter import ADAPTER  # noqa: F401\n")
    settings = (tmp_path / "conformance-pytest.toml").read_text()
    assert f"#     {GATE}\n" in settings
    (tmp_path / "pyproject.toml").write_text(settings)
    env = {**os.environ, "PYTEST_ADDOPTS": "--hypothesis-profile=conformance-quick -k determinism_precondition"}
    env.pop("PYTEST_XDIST_WORKER", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    gate = subprocess.run(GATE, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert gate.returncode == 0 and "1 passed" in gate.stdout, gate.stdout[-3000:] + gate.stderr[-2000:]
    assert "conformance_adapter:ADAPTER" in gate.stdout and (tmp_path / "conformance-report" / "report.json").is_file()

    workflow = (tmp_path / ".github/workflows/checkpoint-conformance.yml").read_text()
    adapter = re.search(r"^  ADAPTER: (\S+)", workflow, re.MULTILINE).group(1)
    step = subprocess.run(["bash", "-e", "-c", _gate_step(workflow)], cwd=tmp_path, env={**env, "ADAPTER": adapter},
                          capture_output=True, text=True, timeout=900)
    assert step.returncode == 0 and "1 passed" in step.stdout, step.stdout[-3000:] + step.stderr[-2000:]
    assert (tmp_path / "conformance-report" / "junit.xml").is_file()
