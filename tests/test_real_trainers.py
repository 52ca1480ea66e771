"""The suite judged against trainers built on real libraries (PyTorch Lightning, Hugging Face
Accelerate), each used the way its documentation shows.

The verdicts are findings about those libraries, recorded as `EXPECTED` in each trainer module and
explained in the README ("Real trainers"); asserting them keeps that write-up executable evidence.
Skipped unless the optional extra is installed: pip install resume-conformance[lightning,accelerate].
"""
from __future__ import annotations

import importlib

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.needs_strace]

TRAINERS = {"lightning": "fixtures.real.lightning_trainer", "accelerate": "fixtures.real.accelerate_trainer"}


@pytest.mark.parametrize("library", sorted(TRAINERS))
def test_suite_verdicts_match_the_recorded_findings(run_suite, library):
    pytest.importorskip(library, reason=f"{library} is not installed (pip install resume-conformance[{library}])")
    trainer = importlib.import_module(TRAINERS[library])
    verdicts, out = run_suite(f"--adapter={trainer.ADAPTER.spec}", "--hypothesis-profile=quick")
    for name, (outcome, message) in verdicts.items():
        if outcome == "failed":
            check = name.removeprefix("test_").split("[")[0]
            first_line = message.strip().splitlines()[0] if message.strip() else ""
            assert f"[{check}" in message, f"{name} failed without its check id (not judged): {first_line}"
    got = {name.removeprefix("test_"): outcome for name, (outcome, _) in verdicts.items()}
    details = "\n\n".join(f"{name}: {message[:1500]}" for name, (outcome, message) in verdicts.items()
                          if outcome != "passed")
    assert got == trainer.EXPECTED, f"{library}: verdicts changed\n{details}\n{out[-2000:]}"
