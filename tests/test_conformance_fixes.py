"""A failure's `fix:` line is chosen from the evidence of the failure (checks/fixes.py, CauseFix), not
fixed per check id: io_error's trainer that raised but lost the errno, and corruption_detected's
deleted pointer file, get their own fix; every other case keeps its check's default. No process is
started: the judges are pure, and a check whose run raises the judged failure stands in for a run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.checks import damage, storage
from conformance.checks.failures import fail
from conformance.checks.fixes import CAUSE_FIXES, ERRNO_LOST, FIXES, POINTER_DELETED, fix_line
from conformance.checks.registry import BY_ID
from conformance.faults.injection import FaultOutcome
from conformance.model.adapters import resolve
from conformance.model.process import ProcessResult
from tests.strategies import judged_fixture, never_plain, resumed_curve

# The fault hit write #4 of the save of step 9; the save of step 6 was committed before it.
SPEC, BASELINE, POINT, KILL = judged_fixture()
LET_IT_RAISE = "let a failed write, fsync or rename raise"
HASHES = "store a hash or size of every file of a checkpoint"
# What torch.save's zip writer (and DCP's exception gather) leaves of an ENOSPC: no errno.
ERRNO_DROPPED = ("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
                 "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])")


def last_line_of_failure(check_id: str, problem: str, fix) -> str:
    """The `fix:` line Check.decide ends a failure with, when the check's run raises `problem` with `fix`."""
    name, _, param = check_id.partition("[")

    def failing(session, check, spec, param, case):
        raise fail(check, resolve(None, None), SPEC, problem, fix=fix)
    with pytest.raises(AssertionError) as info:
        dataclasses.replace(BY_ID[name], run=failing).decide(None, SPEC, param.rstrip("]") or None)
    return str(info.value).splitlines()[-1]


def io_fix_line(first: ProcessResult, final: ProcessResult) -> str:
    found = storage.judge(FaultOutcome(SPEC, POINT, "error=ENOSPC", KILL, first, None, final), "ENOSPC", BASELINE,
                          1e-4, None, same_as_plain=never_plain)
    assert found is not None
    problem, _, fix = found
    return last_line_of_failure("io_error[enospc]", problem, fix)


def up_to(step: int, code: int, stderr: str) -> ProcessResult:
    return ProcessResult(code, {k: v for k, v in BASELINE.items() if k <= step}, stderr)


def resumed(after: int) -> ProcessResult:
    return ProcessResult(0, resumed_curve(BASELINE, after), "")


def test_a_trainer_that_raised_but_lost_the_errno_is_told_to_keep_it_not_to_raise():
    line = io_fix_line(up_to(9, 1, ERRNO_DROPPED), resumed(6))
    assert LET_IT_RAISE not in line
    assert "re-raise" in line and "OSError chained" in line and "torch.save" in line and "DCP" in line
    assert line.endswith("(docs/checks.md#io_error)")


@pytest.mark.parametrize("first, final", [
    (up_to(9, 0, ""), resumed(6)),                                                  # exited 0 after the failed save
    (up_to(14, 0, "warning: background save failed, continuing"), resumed(6)),      # went on without it
], ids=["exited-0", "went-on"])
def test_a_swallowed_write_error_keeps_the_let_it_raise_fix(first, final):
    assert LET_IT_RAISE in io_fix_line(first, final)


def test_a_trainer_that_named_the_errno_is_not_told_it_lost_it():
    line = io_fix_line(up_to(9, 1, "OSError: [Errno 28] No space left on device"), resumed(3))
    assert ERRNO_LOST.fix not in line and LET_IT_RAISE in line


def checkpoint_dir(root: Path, pointer: str | None = None) -> Path:
    """Checkpoints of steps 9 and 12 as directories, with a per-checkpoint index each and `latest`
    holding `pointer`."""
    for step in (9, 12):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
        (d / "index.json").write_text(f'{{"step": {step}, "files": {{"model.pt": "3f2a12b0"}}}}')
    (root / "step-00000012.chain.json").write_text('{"base": "step-00000009.chain.json", "pieces": ["a12"]}')
    (root / "global_step12").mkdir()
    if pointer is not None:
        (root / "latest").write_text(pointer)
    return root


@pytest.mark.parametrize("text", ["step-00000012", "step-00000012.chain.json\n", "global_step12", "12\n",
                                  '{"latest": "step-00000012", "step": 12}'])
def test_a_small_text_file_naming_the_newest_checkpoint_is_a_pointer(tmp_path, text):
    assert damage.is_pointer(checkpoint_dir(tmp_path, text), "latest", 12)


@pytest.mark.parametrize("rel, text", [
    ("step-00000012/model.pt", None),          # a checkpoint's own data (binary)
    ("step-00000012/index.json", None),        # a checkpoint's own manifest: the step in its name
    ("latest", "step-00000009"),               # names an older checkpoint, not the newest
    ("latest", "step-00000099"),               # names nothing the directory holds
    ("latest", "3f2a12b0 a12"),                # digests with the step's digits inside them
    ("latest", "11"),
])
def test_a_checkpoints_own_files_and_stale_names_are_not_pointers(tmp_path, rel, text):
    assert not damage.is_pointer(checkpoint_dir(tmp_path, text), rel, 12)


def test_a_deleted_pointer_gets_the_pointer_fix_not_hashes(tmp_path):
    ckpt = checkpoint_dir(tmp_path, "step-00000012.chain.json")
    fix = damage.fix_for("delete", ckpt, "latest", 12)
    assert fix is POINTER_DELETED
    line = last_line_of_failure("corruption_detected[delete]", "after corruption the trainer resumed from scratch "
                                "instead of falling back to the newest intact checkpoint (step 9)", fix)
    assert HASHES not in line and "never require a pointer file" in line and "scan the directory" in line
    assert line.endswith("(docs/checks.md#corruption_detected)")


@pytest.mark.parametrize("kind, rel", [("bitflip", "step-00000012/model.pt"), ("bitflip", "latest"),
                                       ("truncate", "step-00000012/model.pt"), ("delete", "step-00000012/model.pt")])
def test_other_damage_keeps_the_hash_fix(tmp_path, kind, rel):
    ckpt = checkpoint_dir(tmp_path, "step-00000012")
    fix = damage.fix_for(kind, ckpt, rel, 12)
    assert fix is None
    line = last_line_of_failure(f"corruption_detected[{kind}]", "the trainer loaded a corrupted checkpoint", fix)
    assert HASHES in line


def test_a_cause_fix_is_for_a_known_check_and_replaces_only_that_checks_default():
    for cause in CAUSE_FIXES:
        assert cause.check in FIXES and cause.fix != FIXES[cause.check] and cause.cause
        assert cause.fix in fix_line(f"{cause.check}[x]", cause)
        other = next(c for c in FIXES if c != cause.check)
        assert fix_line(other, cause) == fix_line(other)   # another check's cause never changes this one's line
    assert FIXES["io_error"] in fix_line("io_error[eio]")
