"""What to change when a check fails: one line per check, ending every failure message (`fix:`) and
rendered, with each check's summary, as docs/checks.md.

FIXES is each check's default. Where a check's evidence tells one cause from another and the cause
changes what to fix, the check passes that cause's CauseFix with its failure (`fail(..., fix=...)`)
and the `fix:` line says it instead: the fix is chosen from what the runs showed, not from the check id.
"""
from __future__ import annotations

import dataclasses

DOCS_PAGE = "docs/checks.md"

FIXES = {
    "determinism_precondition":
        "make two runs with the same CONFORMANCE_SEED identical: seed every RNG from it (Python, NumPy, torch, "
        "each CUDA device, the data loader's generator and workers), set torch.use_deterministic_algorithms(True), "
        "and write checkpoints in the same order with the same names (temp names may be random)",
    "resume_matches_baseline":
        "save and restore everything the next step depends on: model parameters and buffers, optimizer, LR "
        "scheduler, the step, epoch and batch-in-epoch counters, every RNG, and the data position; the likely "
        "cause above says which",
    "no_lost_work":
        "on start, resume from the newest checkpoint that is complete (verify it, do not take the newest name); "
        "write a new checkpoint beside the old ones and delete old ones only after the new one is committed",
    "no_torn_state":
        "write each file to a unique temp name in the same directory, fsync it, os.replace it into place, fsync "
        "the directory; for several files, commit them with an index or marker written last",
    "crash_states":
        "make the commit point (a rename, or an index or marker written last) the only step that makes a "
        "checkpoint visible, and have the loader skip what is not committed",
    "power_loss":
        "fsync every file before renaming it into place, fsync the directory after the rename, and never load "
        "a checkpoint whose files fail their hash: fall back to the previous one",
    "io_error":
        "let a failed write, fsync or rename raise (or retry the whole save into a new temp file until it "
        "commits): never rename a file whose fsync failed, never train on to exit 0 without the failed step's "
        "checkpoint (a background saver's error too), and keep the previous checkpoint until the new one is "
        "committed",
    "preemption":
        "on SIGTERM set a flag, finish or abandon the save in progress, save once at the next step boundary and "
        "exit non-zero (128+15) within the grace period; never exit 0 before the last step",
    "rank_resume":
        "save and restore each rank's own state (its RNGs, its data sampler position) and make every rank "
        "resume from the same checkpoint (agree on the step, e.g. by a collective)",
    "all_or_nothing":
        "commit a multi-rank checkpoint only after every rank finished writing (a barrier, then one marker or "
        "index written last by one rank), and have every rank load only committed checkpoints",
    "hang":
        "give the process group a timeout (init_process_group(timeout=...), CONFORMANCE_HANG_TIMEOUT under the "
        "suite) so a rank waiting for a stopped peer raises and exits non-zero, and commit only after every rank "
        "finished its part",
    "reshard":
        "save a world-size independent state (torch.distributed.checkpoint plans and reshards on load) and the "
        "data position in global samples, not per rank",
    "corruption_detected":
        "store a hash or size of every file of a checkpoint and check it before loading; on a mismatch fall back "
        "to an older checkpoint or exit non-zero naming the file",
    "untrusted_checkpoint":
        "load with torch.load(..., weights_only=True) (or safetensors), never with pickle or weights_only=False; "
        "keep non-tensor state in JSON",
    "elastic_restart":
        "make every start of a worker, a restart in place too (TORCHELASTIC_RESTART_COUNT > 0), look for the newest "
        "committed checkpoint in the same place a new job does, and resume from it as any resume",
    "node_loss":
        "upload a checkpoint to the cold tier completely, verify it, then write its commit marker last; on a start "
        "with an empty local directory, resume from the newest committed checkpoint in the cold tier. With "
        "node-local storage: before the commit, copy each node's part to another node (a replica) or to shared "
        "storage, and on a start restore every rank from whichever copy survives (reference.multirank.replicated)",
    "branch_resume":
        "resume from CONFORMANCE_RESUME_FROM into a new branch: write the new checkpoints beside the old line, "
        "never over it, and let retention keep what another branch needs",
    "demotion_safe":
        "delete a local checkpoint only after its cold copy is verified (hash compared after the upload) and "
        "committed by its marker; verify cold copies on load",
    "restart_after_finish":
        "on start, resume from the newest checkpoint and train only the steps after it: a run whose checkpoint "
        "is at or past the last step exits 0 at once, never restarts its counters or trains again over it",
    "extend_run":
        "take the total number of steps from the new run's configuration, not from the checkpoint, and keep "
        "the schedule a function of the step (or drop the capability 'extendable' if it depends on the total)",
    "interrupt":
        "let KeyboardInterrupt abandon a save in progress: remove its temp files, never commit in a `finally` "
        "or an `__exit__` that ignores the exception; save on Ctrl-C only at a step boundary, then exit non-zero",
    "compound_faults":
        "delete old checkpoints only after the new one is committed (retention last), and on start fall back "
        "past a damaged newest checkpoint to the next older one that verifies",
    "upgrade_resume":
        "keep checkpoints free of version-bound objects (tensors and JSON, not pickled classes of one numpy "
        "or library version), write a schema version and migrate on load instead of refusing another version",
    "schema_migration":
        "register a migration for every older checkpoint format and run it on load; refuse a newer format "
        "with an error naming both versions",
}


@dataclasses.dataclass(frozen=True)
class CauseFix:
    """What to change for one cause of one check's failure, in place of the check's default."""

    check: str     # the check id, without its parameter
    cause: str     # the evidence that tells this cause apart, in words (docs/checks.md)
    fix: str


ERRNO_LOST = CauseFix(
    "io_error", "the trainer exited non-zero but its stderr does not name the injected errno",
    "make the error that reaches the top name the errno (ENOSPC, EIO), not only a wrapper's message; re-raise "
    "where a save fails with the original OSError chained (`raise ... from err`, never `from None`) and let the "
    "whole chain print; torch.save to a path turns ENOSPC or EIO into `RuntimeError: ... unexpected pos` and keeps "
    "the OSError only as its __context__ (torch.save to an open file object raises the OSError), and DCP's "
    "exception gather drops even that (log each rank's own OSError before DCP gathers it)")
FSYNC_FAILED_COMMITTED = CauseFix(
    "io_error", "the trainer renamed into place (committed) a file whose fsync had failed",
    "abandon a file whose fsync failed, never retry the fsync and rename it into place (the kernel may have "
    "dropped its data, fsyncgate); raise, or write the whole save anew into a new temp file, and keep the "
    "previous checkpoint until the new one is committed")
POINTER_DELETED = CauseFix(
    "corruption_detected", "the file deleted (`[delete]`) is a pointer such as `latest` (small text naming the newest "
    "checkpoint)",
    "never require a pointer file (such as `latest`) to find a checkpoint: when it is missing, or names a checkpoint "
    "that is not there or not complete, scan the directory for the newest checkpoint that is complete and verifies, "
    "and resume from it; write the pointer last (temp file, fsync, os.replace)")

EXITED_BEFORE_STEP_1 = CauseFix(
    "determinism_precondition", "an uninterrupted run exited non-zero before it logged any step (at import or set-up)",
    "make the trainer start under the suite's environment: run the command of the run line by hand with the "
    "CONFORMANCE_* variables set and read its stderr (shown above); a module that calls sys.exit() or raises while it is "
    "imported or set up (a missing variable, a device or version check, a lock another process holds) stops every "
    "process the suite starts")

STALLED_BEFORE_STEP_1 = CauseFix(
    "determinism_precondition", "an uninterrupted run was stopped, stalled or over its time limit, before it logged "
    "any step",
    "find what the trainer waits on before its first step (the message says what the suite saw): remove a stale lock "
    "file that a process killed while holding it left behind, and give every wait at start (a lock, a download, a "
    "rendezvous, a read of stdin) a timeout that raises naming what it waited for")

CAUSE_FIXES: tuple[CauseFix, ...] = (ERRNO_LOST, FSYNC_FAILED_COMMITTED, POINTER_DELETED, EXITED_BEFORE_STEP_1,
                                     STALLED_BEFORE_STEP_1)


def fix_line(check_id: str, fix: CauseFix | None = None) -> str:
    """`  fix:      <what to change> (docs/checks.md#<check>)` for `check` or `check[param]`; `fix`, a
    cause the check's evidence found, replaces the check's default where it is this check's."""
    name = check_id.partition("[")[0]
    text = fix.fix if fix is not None and fix.check == name else FIXES[name]
    return f"  fix:      {text} ({DOCS_PAGE}#{name})"
