"""The one list of checks: each id, its parameters, what it needs, the function that decides it,
how `replay` reruns it, a short title and a full summary.

suite.py builds its test methods from this table, `python -m conformance replay` its options,
the expected-failures file is validated against it, reports and the docs' check pages
(report/checks_page.py) are rendered from it, and the broken-fixture catalogue is checked against it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import strategies as st

from ..faults import strategies
from ..faults.corrupt import KINDS
from ..model import evidence
from ..model.crash import ColdFault, CrashPoint, Schedule, bound, format_schedule, parse_schedule
from ..model.process import RunSpec
from ..run.runners import ProcessOverran
from . import (
    compound,
    damage,
    determinism,
    elastic,
    hang,
    interrupt,
    legacy,
    lifecycle,
    nodes,
    power,
    preemption,
    ranks,
    schedules,
    states,
    storage,
    tiers,
    untrusted,
    upgrade,
)
from .failures import ConformanceFailure, stderr_tail
from .fixes import fix_line
from .session import Session


@dataclasses.dataclass(frozen=True)
class CaseOption:
    """The command-line option `replay` takes for one case of a check (and how to read it)."""

    name: str
    help: str
    parse: Callable[[str], object] = str
    required: bool = False


@dataclasses.dataclass(frozen=True)
class ByCase:
    """A check's `run` that hands each kind of case to a function of its own (the first whose type it is)."""

    deciders: tuple[tuple[type, Callable], ...]

    def __call__(self, session: Session, check_id: str, spec: RunSpec, param: str | None, case: object) -> object:
        return next(run for kind, run in self.deciders if isinstance(case, kind))(session, check_id, spec, param, case)


@dataclasses.dataclass(frozen=True)
class Check:
    id: str
    title: str                         # one short line: the README's table (docs/checks.md has the summary)
    summary: str
    run: Callable                      # run(session, check_id, spec, param, case), or a ByCase
    params: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()        # "trace", or adapter capabilities such as "legacy_samples"
    precondition: str = "losses"       # "none", "losses", or "operations" (losses and filesystem ops)
    draw: Callable[[object, str | None], st.SearchStrategy] | None = None   # Hypothesis-drawn cases
    case: CaseOption | None = None

    @property
    def decided_in(self) -> tuple[str, ...]:
        """The modules that decide it (paths): its `run` function's, or each of a ByCase's functions'."""
        runs = [f for _, f in self.run.deciders] if isinstance(self.run, ByCase) else [self.run]
        return tuple(dict.fromkeys(f"{f.__module__.replace('.', '/')}.py" for f in runs))

    def ids(self) -> list[str]:
        return [f"{self.id}[{p}]" for p in self.params] or [self.id]

    def decide(self, session: Session, spec: RunSpec, param: str | None = None, case: object = None) -> object:
        """Run the check once; raises ConformanceFailure with the report if it fails."""
        check_id = f"{self.id}[{param}]" if param else self.id
        if isinstance(case, CrashPoint):
            case = case.bound(spec.ranks_per_node)
        elif isinstance(case, tuple) and all(isinstance(p, CrashPoint) for p in case):
            case = bound(case, spec.ranks_per_node)
        try:
            return self._run(session, check_id, spec, param, case)
        except ConformanceFailure as exc:     # every failure ends with what to change
            if "\n  fix:" not in str(exc):
                exc.args = (f"{exc}\n{fix_line(check_id, exc.fix)}",)
            for warning in evidence.warnings():   # a helper that can race the next start (run/watchdog.py)
                if warning not in str(exc):
                    exc.args = (f"{exc}\n  warning:  {warning}",)
            raise

    def _run(self, session: Session, check_id: str, spec: RunSpec, param: str | None, case: object) -> object:
        try:
            return self.run(session, check_id, spec, param, case)
        except ProcessOverran as exc:
            split = exc.result.ranks_disagree()
            why = f" (its ranks had resumed from different steps: {split}, so their collectives never matched)" \
                if split else ""
            raise session.fail(check_id, spec, f"a trainer process {exc.problem}; it was killed{why}",
                               details=(exc.details + "\n" if exc.details else "") + "  stderr:\n"
                               + stderr_tail(exc.result.stderr),
                               case=({self.case.name: case_text(self, case)} if self.case and case is not None
                                     else None)) from None


_SCHEDULE = CaseOption("schedule", "crash schedule, e.g. save:6/3,step:4", parse_schedule, required=True)
_STATE = CaseOption("state", "one state, by label (e.g. 37, or 37t for a torn write)")
_FILE = CaseOption("file", "one damaged file, relative to the checkpoint directory (e.g. pieces/3f2a...)")
def _parse_lost_at(text: str) -> int | CrashPoint:
    text = text.strip()
    return int(text) if text.isdigit() else CrashPoint.parse(text)


_LOST_AT = CaseOption("lost_at", "where the node is lost: N, killed before the Nth change to the cold tier (1-based; "
                      "past the last: no kill); or, with node-local storage in a job of several nodes, a node point "
                      "such as save:6/3@node1", _parse_lost_at, required=True)


def _node_loss_cases(baseline) -> st.SearchStrategy:
    spec = baseline.spec
    return strategies.node_points(baseline) if spec.node_local and spec.nnodes >= 2 else tiers.kill_points(baseline)
_COLD_FAULT = CaseOption("cold_fault", "a fault at a change to the cold tier: kill:N (die just before change N) or "
                         "garble:N (flip a byte of the object change N wrote)", ColdFault.parse, required=True)
_POINT = CaseOption("point", "one fault point, e.g. save:6/3 or step:4", CrashPoint.parse, required=True)


def _no_lost_work_points(baseline, where: str) -> st.SearchStrategy[Schedule]:
    points = strategies.after_save_points(baseline) if where == "between_saves" else \
        st.one_of(strategies.in_save_points(baseline), strategies.fs_points(baseline))
    return points.map(lambda p: (p,))


CHECKS: tuple[Check, ...] = (
    Check("determinism_precondition", "two uninterrupted runs give the same losses and filesystem operations",
          "two uninterrupted runs agree: the same losses and the same filesystem operations (names that "
          "differ between runs, such as random temp names, are learned and allowed); otherwise the resume "
          "checks skip",
          determinism.determinism_precondition, precondition="none"),
    Check("resume_matches_baseline", "after any crash schedule, every loss matches the uninterrupted run",
          "after any crash schedule (plain kills, nothing corrupted) the trainer finishes with exit 0 and "
          "every loss it logs matches the uninterrupted run: bit for bit when its two uninterrupted runs are, "
          "else within the tolerance learned from their noise (at most --loss-tol)",
          schedules.resume_matches_baseline, needs=("trace",),
          precondition="operations", draw=lambda b, _: strategies.schedules(b, max_crashes=2), case=_SCHEDULE),
    Check("no_lost_work", "a restart resumes from the newest checkpoint committed before the kill",
          "after each crash it resumes from the newest checkpoint committed before the kill, not an older "
          "one or from scratch: killed right after a save (is the newest one found?) or inside a save (is "
          "the previous one kept while the next is written?)",
          schedules.no_lost_work, params=("between_saves", "inside_save"),
          needs=("trace",), precondition="operations", draw=_no_lost_work_points, case=_SCHEDULE),
    Check("no_torn_state", "after a kill inside a save, it resumes from a complete checkpoint",
          "after a kill inside a save, the next process resumes from a complete checkpoint (the previous or "
          "the interrupted one) and matches the baseline, or at least a plain resume from that checkpoint",
          schedules.no_torn_state, needs=("trace",), precondition="operations",
          draw=lambda b, _: strategies.in_save_points(b).map(lambda p: (p,)), case=_SCHEDULE),
    Check("crash_states", "every state a kill can leave, rebuilt offline, resumes correctly",
          "every state a kill can leave during a whole run (before each recorded filesystem operation, and "
          "with each write torn in half), rebuilt offline from one recording: the trainer resumes from the "
          "newest committed checkpoint (or the interrupted one, if complete) and its next step matches",
          states.crash_states_check, needs=("trace",), case=_STATE),
    Check("power_loss", "every state a power cut can leave (only fsynced data kept) resumes correctly",
          "every state a power cut before a recorded operation leaves, rebuilt offline: `data` keeps only "
          "fsynced bytes (directory operations persist in order), `strict` also rolls back directory entries "
          "whose directory was not fsynced after them; the trainer never loads bad data, never crash-loops "
          "while an intact checkpoint exists, and resumes from at least the newest save that had completed "
          "(the next step was logged)",
          power.power_loss, params=("data", "strict"), needs=("trace",), case=_STATE),
    Check("io_error", "ENOSPC or EIO inside a save is reported or retried, never committed as if written",
          "a write, fsync, rename or mkdir of a save fails with ENOSPC or EIO: the trainer exits non-zero "
          "naming the error, or goes on training and commits that step's save after all (a retry) before its "
          "next save, never exit 0 without it; it never renames a file into place after its fsync failed "
          "(fsyncgate); the next start resumes from at least the checkpoint committed before the failure and "
          "matches the baseline",
          storage.io_error, params=("enospc", "eio"), needs=("trace",),
          precondition="operations", draw=strategies.error_points, case=_POINT),
    Check("preemption", "SIGTERM, then SIGKILL after a grace period: no early exit 0, a correct resume",
          "SIGTERM at a step or inside a save, SIGKILL after --grace-seconds: the trainer never exits 0 before "
          "TOTAL_STEPS, and the next start resumes correctly; with capability `preemption_save` it exits within "
          "the grace period and the next start loses no step",
          preemption.preemption, needs=("trace",), precondition="operations",
          draw=lambda b, _: strategies.term_points(b), case=_POINT),
    Check("interrupt", "Ctrl-C mid-save: it exits within the grace period and resumes correctly",
          "Ctrl-C's SIGINT at a step or inside a save (a background save's too; a job's whole process group), "
          "so KeyboardInterrupt runs every handler mid-save: the trainer exits within --grace-seconds and not 0 "
          "before TOTAL_STEPS, and the next start resumes from at least the newest committed checkpoint and "
          "matches (no torn or mixed state committed)",
          interrupt.interrupt, needs=("trace",), precondition="operations",
          draw=lambda b, _: strategies.term_points(b), case=_POINT),
    Check("compound_faults", "a crash, then the newest checkpoint damaged: it falls back safely",
          "a kill (`kill_then_damage`) or a power cut (`power_then_damage`) inside a save, then the newest "
          "committed checkpoint damaged: the next start falls back to the checkpoint the trainer's own retention "
          "kept beside it in the uninterrupted run (or newer, intact) and matches; with nothing kept, it may "
          "start over or exit non-zero, never train on the damage",
          compound.compound_faults, params=compound.PARAMS, needs=("trace",), draw=compound.draw_state, case=_STATE),
    Check("restart_after_finish", "started again after finishing: it exits 0 and trains no step twice",
          "after an uninterrupted run, the trainer started again with the same environment exits 0 and trains "
          "no step its newest checkpoint holds; any step it trains matches the baseline; for the run as given and "
          "for one lengthened to end on its save cadence, whose last step is checkpointed",
          lifecycle.restart_after_finish, needs=("trace",)),
    Check("extend_run", "a larger total after a finished run trains the new steps exactly",
          "after a run to TOTAL_STEPS, a start with a larger total trains the new steps, and their losses equal "
          "a fresh run to the larger total",
          lifecycle.extend_run, needs=("trace", "extendable")),
    Check("upgrade_resume", "checkpoints resume across a dependency upgrade and a rollback",
          "checkpoints cross a dependency change (--resume-python=PATH: another torch, numpy, transformers or "
          "trainer library): saved here and resumed under PATH (`rollback`), saved under PATH and resumed here "
          "(`upgrade`); each resume matches the baseline of the environment that resumes, never refuses or crashes",
          upgrade.upgrade_resume, params=upgrade.PARAMS, needs=("resume_python",)),
    Check("rank_resume", "one rank killed at a step: every rank resumes from that step on its own curve",
          "one rank of a multi-rank job killed at a step boundary: every rank resumes from the same step and "
          "every rank's loss matches that rank's own uninterrupted curve (a rank whose RNG or data position "
          "was not restored is named even when rank 0 is fine)",
          ranks.rank_resume, needs=("trace", "multirank"), precondition="operations",
          draw=lambda b, _: strategies.step_points(b, nodes=True), case=_POINT),
    Check("all_or_nothing", "one rank killed inside a save: only checkpoints every rank finished are used",
          "one rank of a multi-rank job killed inside a save, at any operation of any rank: the next start "
          "uses only a checkpoint every rank finished (never a mix of two steps' shards), every rank from the "
          "same one, and every rank's loss matches its own uninterrupted curve",
          ranks.all_or_nothing, needs=("trace", "multirank"),
          precondition="operations", draw=lambda b, _: strategies.save_end_points(b, nodes=True), case=_POINT),
    Check("elastic_restart", "torchrun restarts the workers in place and they resume correctly",
          "one rank of a multi-rank job killed inside a save, the job launched with torchrun's --max-restarts=1: "
          "torchrun restarts the workers in place (no new job), and they resume from at least the newest "
          "checkpoint committed before the kill, every rank from the same one, each on its own uninterrupted "
          "curve, and the job exits 0",
          elastic.elastic_restart, needs=("trace", "multirank"),
          precondition="operations", draw=lambda b, _: elastic.restart_points(b), case=_POINT),
    Check("hang", "a rank frozen inside a save: the job ends within --hang-timeout, never hangs",
          "one rank of a multi-rank job frozen (SIGSTOP) inside a save: the job notices (a rank's collective times "
          "out) and ends within --hang-timeout, never hangs; after the stopped rank is killed the next start resumes "
          "from at least the newest committed checkpoint and matches",
          hang.hang, needs=("trace", "multirank"), precondition="operations",
          draw=lambda b, _: strategies.in_save_points(b), case=_POINT),
    Check("reshard", "saved with W ranks, resumed with 1 (and back): same step, same global loss",
          "save with W ranks and resume with 1 (`shrink`), save with 1 and resume with W (`grow`): the job "
          "resumes at the saved step and the global loss (the mean of the ranks') matches the W-rank run",
          ranks.reshard, params=("shrink", "grow"), needs=("trace", "multirank", "reshard")),
    Check("corruption_detected", "a truncated, bit-flipped or deleted file is detected, never trained on",
          "each file a resume from the newest checkpoint reads (a chained checkpoint's base pieces too), one "
          "per resume, is truncated, bit-flipped (top exponent bit of every float tensor's first element) or "
          "deleted: the trainer falls back to an intact checkpoint and matches, or exits non-zero with a "
          "message, never exit 0 on a diverging curve",
          damage.corruption_detected, params=KINDS, needs=("trace",), case=_FILE),
    Check("untrusted_checkpoint", "a malicious pickle in a checkpoint never runs",
          "each file of the newest checkpoint in turn is replaced by a pickle that runs code when loaded; "
          "that code must never run",
          untrusted.untrusted_checkpoint, needs=("trace",), precondition="none"),
    Check("node_loss", "a lost checkpoint directory or node: it resumes from what survives",
          "killed just before any change to the cold tier (an upload, a marker, a deletion; or not at all), then "
          "the checkpoint directory is wiped: the next start resumes from the cold tier, from at least the save "
          "before the newest one logged before the kill, and matches the baseline. With node-local storage in a "
          "job of several nodes (`--nnodes`): a whole node lost inside a save or at a step, with its directory; "
          "the next job resumes from what survives (a replica, the shared directory, the cold tier), from at "
          "least the save before the newest committed one, and every rank matches",
          # the cold-tier case (a number) or the multi-node case (a node point), by what was drawn
          ByCase(((int, tiers.node_loss), (object, nodes.node_loss))), needs=("trace", "lost_node_storage"),
          draw=lambda b, _: _node_loss_cases(b), case=_LOST_AT),
    Check("branch_resume", "resumed from an older checkpoint: it matches and keeps the original line intact",
          "after a whole run, resumed from an older checkpoint (CONFORMANCE_RESUME_FROM: the best one by the metric "
          "it logs, with capability keep_best): it resumes at that step, its new curve matches the baseline, and "
          "every file of the original line is still there byte for byte",
          tiers.branch_resume, needs=("trace", "resume_from")),
    Check("demotion_safe", "a crash or a corrupt cold copy never costs a loadable checkpoint",
          "killed just before any change to the cold tier, or one object it writes silently corrupted, then run to "
          "the end: resumed from the checkpoint branch_resume asks for (CONFORMANCE_RESUME_FROM), it still loads and "
          "matches the baseline; a hot copy is never deleted before its cold copy is verified",
          tiers.demotion_safe, needs=("trace", "cold_tier", "resume_from"),
          draw=lambda b, _: tiers.fault_points(b), case=_COLD_FAULT),
    Check("schema_migration", "legacy samples load and resume at their step",
          "legacy samples load, and the run resumes at their step and matches the baseline",
          legacy.schema_migration, needs=("legacy_samples",), precondition="none",
          case=CaseOption("legacy", "one legacy sample, by name")),
)
BY_ID = {c.id: c for c in CHECKS}


def all_check_ids() -> list[str]:
    """Every test id a run can have: `check` or `check[param]`."""
    return [i for c in CHECKS for i in c.ids()]


def split_id(check_id: str) -> tuple[Check, str | None]:
    """`no_lost_work[inside_save]` -> (the no_lost_work entry, "inside_save"); KeyError if unknown."""
    name, _, rest = check_id.partition("[")
    check = BY_ID[name]
    param = rest[:-1] if rest.endswith("]") else None
    if (param is None) != (not check.params) or (param is not None and param not in check.params):
        raise KeyError(check_id)
    return check, param


def skip_reason(check: Check, session: Session, spec: RunSpec) -> str | None:
    """Why `check` cannot run for this trainer here (the skip message), or None."""
    for need in check.needs:
        if need == "trace":
            problem = session.trace_problem()
            if problem:
                return problem
        elif need == "resume_python":
            if not session.resume_python:
                return ("needs another Python environment to resume in: --resume-python=PATH (ini "
                        "conformance_resume_python)")
        elif need == "lost_node_storage":
            if not session.adapter.has("cold_tier") and not (session.adapter.has("node_local_storage")
                                                             and spec.nnodes >= 2):
                return ("adapter lacks capability 'cold_tier' (or 'node_local_storage' in a job of several nodes: "
                        "--nnodes >= 2)")
        elif need == "multirank":
            if session.adapter.world_size < 2:
                return "needs a multi-rank trainer (world size >= 2: --world-size or the adapter's world_size)"
        elif not session.adapter.has(need):
            return session.adapter.lacks(need)
    if check.id != "determinism_precondition":
        try:
            session.baseline(spec)
        except ConformanceFailure:
            return "the trainer's uninterrupted run failed (see determinism_precondition)"
    if check.precondition in ("losses", "operations"):
        found = session.determinism(spec)
        if found.losses_problem:
            return "not deterministic without interruption (see determinism_precondition)"
        if check.precondition == "operations" and found.operations_problem:
            return ("its filesystem operations differ between two uninterrupted runs, so crash points cannot "
                    "be replayed (see determinism_precondition)")
    return None


def case_text(check: Check, case: object) -> str:
    return format_schedule(case) if check.case is _SCHEDULE else str(case)


# Conformance levels: a one-line claim for a README or a model card. A level is met when every one
# of its checks (and every lower level's) passed; an expected failure does not count, and a level
# with a check that did not run is "not tested", never met.
LEVELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("L1", "process-crash safe", ("determinism_precondition", "resume_matches_baseline", "no_lost_work",
                                  "no_torn_state", "crash_states", "corruption_detected", "untrusted_checkpoint")),
    ("L2", "power-loss durable", ("power_loss",)),
    ("L3", "fault tolerant", ("io_error", "preemption", "interrupt", "compound_faults", "restart_after_finish")),
    ("L4", "multi-rank consistent", ("all_or_nothing", "rank_resume")),
)


def level_ids(checks: tuple[str, ...]) -> list[str]:
    """The test ids a level needs: each check with each of its parameters (unknown checks as given)."""
    return [i for c in checks for i in (BY_ID[c].ids() if c in BY_ID else [c])]
