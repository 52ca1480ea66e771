"""The suite judged against known trainers: every correct trainer passes every check, and each
deliberately broken trainer fails with the check id that should catch it.

These run the suite the way a team does, `pytest --pyargs conformance`, in a subprocess, and read
the verdicts from its JUnit XML.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.tracing import strace_problem
from fixtures import CORRECT_TRAINERS
from fixtures.broken import CATALOGUE
from suite_runner import run_suite

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


needs_strace = pytest.mark.skipif(strace_problem() is not None, reason=f"strace unusable: {strace_problem()}")


@needs_strace
@pytest.mark.parametrize("adapter", CORRECT_TRAINERS)
def test_correct_trainer_passes_every_check_under_ci_profile(tmp_path, adapter):
    if adapter.startswith("fixtures.commit_marker_trainer"):
        pytest.importorskip("safetensors", reason="the commit-marker trainer needs the 'safetensors' extra")
    verdicts, out = run_suite(tmp_path, f"--adapter={adapter}", "--hypothesis-profile=ci")
    assert verdicts, out[-3000:]
    bad = {name: v for name, v in verdicts.items() if v[0] in ("failed", "error")}
    assert not bad, "\n\n".join(f"{n}: {m[:2000]}" for n, (_, m) in bad.items())
    skipped = {name: v[1] for name, v in verdicts.items() if v[0] == "skipped"}
    assert not skipped, skipped
    assert any(name.startswith("test_schema_migration") for name in verdicts)


@needs_strace
@pytest.mark.parametrize("trainer", sorted(CATALOGUE))
def test_broken_trainer_fails_with_the_intended_check(tmp_path, trainer):
    bug, check = CATALOGUE[trainer]
    verdicts, out = run_suite(tmp_path, f"--adapter=fixtures.broken.{trainer}:ADAPTER",
                              "--hypothesis-profile=quick", "-k", f"test_{check} or test_determinism_precondition")
    if check != "determinism_precondition":
        assert verdicts.get("test_determinism_precondition", ("missing",))[0] == "passed", verdicts
    failed = {name: message for name, (outcome, message) in verdicts.items()
              if outcome == "failed" and (name == f"test_{check}" or name.startswith(f"test_{check}["))}
    assert failed, f"{trainer} ({bug}) was not caught by {check}: {verdicts}\n{out[-2000:]}"
    message = next(iter(failed.values()))
    assert f"[{check}]" in message, message[:2000]
    assert "replay:   python -m conformance replay" in message
