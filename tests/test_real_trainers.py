"""The suite judged against trainers built on real libraries (PyTorch Lightning, Hugging Face
Accelerate and Transformers, PyTorch's DCP on 2 ranks), each used the way its documentation shows.

The verdicts are findings about those libraries, recorded as `EXPECTED` in each trainer module and
explained in the README ("Real trainers"); asserting them keeps that write-up executable evidence.
Skipped unless the optional extra is installed: pip install resume-conformance[lightning,accelerate,transformers].
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_conformance_gate import HANG_TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.needs_strace]

TRAINERS = {"lightning": "resume_conformance.fixtures.real.lightning_trainer",
            "accelerate": "resume_conformance.fixtures.real.accelerate_trainer",
            "transformers": "resume_conformance.fixtures.real.hf_trainer", "dcp": "resume_conformance.fixtures.real.dcp_trainer"}
# What each library is imported as (DCP comes with torch).
IMPORTS = {"dcp": "torch.distributed.checkpoint"}
# transformers 4.x next to the installed 5.x: a venv with system site packages (same torch), made by
# .ci/run; the suite forks its trainer processes from that interpreter, warm.
# numpy 1.26 next to the installed 2.x, the same way: upgrade_resume's other environment.
NP126_PYTHON = Path(os.environ.get("CONFORMANCE_NP126_PYTHON",
                                   Path(__file__).resolve().parents[1] / ".venv-np126" / "bin" / "python"))
HF4_PYTHON = Path(os.environ.get("CONFORMANCE_HF4_PYTHON", Path(__file__).resolve().parents[1] / ".venv-hf4" / "bin" / "python"))


@pytest.mark.parametrize("library", sorted(TRAINERS))
def test_suite_verdicts_match_the_recorded_findings(run_suite, library):
    pytest.importorskip(IMPORTS.get(library, library),
                        reason=f"{library} is not installed (pip install resume-conformance[{library}])")
    trainer = importlib.import_module(TRAINERS[library])
    if not trainer.EXPECTED:
        pytest.skip(f"no recorded findings for this version of {library}")
    if not NP126_PYTHON.exists():
        pytest.skip(f"no numpy 1.26 interpreter at {NP126_PYTHON} for upgrade_resume (.ci/run makes one)")
    hang = [HANG_TIMEOUT] if trainer.ADAPTER.world_size > 1 else []   # why: tests/test_conformance_gate.py
    verdicts, out = run_suite(f"--adapter={trainer.ADAPTER.spec}", "--hypothesis-profile=conformance-quick",
                              f"--resume-python={NP126_PYTHON}", *hang)
    _assert_verdicts(library, trainer.EXPECTED, verdicts, out)


@pytest.mark.parametrize("configuration", ["DEFAULT", "HARDENED_ASYNC", "HARDENED_ASYNC_2RANKS"])
def test_torchtitan_verdicts_match_the_recorded_findings(run_suite, configuration):
    """torchtitan's own CheckpointManager: its default configuration fails only where torchtitan or
    DCP is at fault, and the hardened one (docs/real-trainers.md) passes every check; async saves
    with a background purge thread among them."""
    pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is not installed (pip install "
                        "resume-conformance[torchtitan], or the --no-deps line in docs/real-trainers.md)")
    from resume_conformance.fixtures.real import torchtitan_trainer
    adapter = getattr(torchtitan_trainer, configuration)
    if not NP126_PYTHON.exists():
        pytest.skip(f"no numpy 1.26 interpreter at {NP126_PYTHON} for upgrade_resume (.ci/run makes one)")
    hang = [HANG_TIMEOUT] if adapter.world_size > 1 else []
    verdicts, out = run_suite(f"--adapter={adapter.spec}", "--hypothesis-profile=conformance-quick",
                              f"--resume-python={NP126_PYTHON}",
                              *hang)
    _assert_verdicts(adapter.name, torchtitan_trainer.EXPECTED[adapter.name], verdicts, out)


@pytest.mark.needs_extra("transformers")   # the suite's own interpreter resumes with transformers 5.x
def test_transformers_4_verdicts_match_the_recorded_findings(run_suite):
    if not HF4_PYTHON.exists():
        pytest.skip(f"no transformers 4.x interpreter at {HF4_PYTHON} (.ci/run makes one)")
    probe = subprocess.run([str(HF4_PYTHON), "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True)
    if not probe.stdout.startswith("4."):
        pytest.skip(f"{HF4_PYTHON} does not import transformers 4.x: {probe.stdout or probe.stderr[-300:]}")
    from resume_conformance.fixtures.real.hf_trainer import EXPECTED_BY_MAJOR
    # upgrade_resume between transformers 4.x (the trainer's interpreter) and 5.x (the suite's).
    verdicts, out = run_suite(f"--trainer-cmd={HF4_PYTHON} -m resume_conformance.fixtures.real.hf_trainer",
                              "--hypothesis-profile=conformance-quick", "-v",
                              f"--resume-python={sys.executable}")
    assert "runner warm" in out
    _assert_verdicts("transformers 4", EXPECTED_BY_MAJOR[4], verdicts, out)


def _assert_verdicts(library: str, expected: dict, verdicts: dict, out: str) -> None:
    for name, (outcome, message) in verdicts.items():
        if outcome == "failed":
            check = name.removeprefix("test_").split("[")[0]
            first_line = message.strip().splitlines()[0] if message.strip() else ""
            assert f"[{check}" in message, f"{name} failed without its check id (not judged): {first_line}"
    got = {name.removeprefix("test_"): outcome for name, (outcome, _) in verdicts.items()}
    # An expected set: the recorded finding shows only where the trainer's own timing lets it.
    got = {name: expected[name] if isinstance(expected.get(name), frozenset) and outcome in expected[name] else outcome
           for name, outcome in got.items()}
    details = "\n\n".join(f"{name}: {message[:1500]}" for name, (outcome, message) in verdicts.items()
                          if outcome != "passed")
    assert got == expected, f"{library}: verdicts changed\n{details}\n{out[-2000:]}"
