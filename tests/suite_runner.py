"""Run the conformance suite the way a team does, `pytest --pyargs conformance`, in a subprocess,
and read the verdicts from its JUnit XML (shared by the tests that judge known trainers)."""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def run_suite(tmp_path: Path, *args: str) -> tuple[dict[str, tuple[str, str]], str]:
    """Run the suite; return {test name: (outcome, message)} and the console output."""
    xml = tmp_path / "junit.xml"
    env = dict(os.environ)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
         f"--junitxml={xml}", f"--basetemp={tmp_path / 'suite'}", "-W", "ignore::DeprecationWarning", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "") + "\n" + (el.text or "")
        verdicts[case.get("name")] = (outcome, message)
    return verdicts, proc.stdout
