"""What a trainer process (or a multi-rank job) is given (the command contract's values) and what it
leaves behind."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from .crash import ColdFault


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The command contract's numbers for one run (the checkpoint dir and loss log vary per process).
    `world_size` > 1, or `torchrun`: the trainer runs as that many ranks under torchrun (launch.py);
    `torchrun` with world_size 1 is a one-rank job (resharding to or from one rank)."""

    total_steps: int
    save_every: int
    seed: int
    world_size: int = 1
    torchrun: bool = False
    # Capability cold_tier: where cold locations live ("file": beside each checkpoint directory;
    # "s3://bucket/prefix": one prefix per checkpoint directory), and a fault at the Nth change to
    # the store (coldstore.py). Capability resume_from: the step a run is told to resume from.
    cold: str | None = None
    cold_fault: ColdFault | None = None
    resume_from: int | None = None
    hang_timeout: float | None = None   # CONFORMANCE_HANG_TIMEOUT: the longest a rank should wait for a peer
    nnodes: int = 1                      # torchrun agents ("nodes") the ranks spread over, evenly (launch.py)
    # Capability node_local_storage: each node gets a directory of its own under the checkpoint
    # directory (node_dir), as its local disk, and all share one (shared_dir).
    node_local: bool = False
    max_restarts: int = 0   # torchrun restarts the workers in place this often after a failure (elastic_restart)

    @property
    def is_job(self) -> bool:
        return self.world_size > 1 or self.torchrun

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that runs `rank` (torchrun numbers ranks node by node)."""
        return rank // self.ranks_per_node

    def but(self, **changes) -> RunSpec:
        """This spec with some numbers changed (the world size kept unless named)."""
        changed = dataclasses.replace(self, **changes)
        if changed.world_size % changed.nnodes:
            raise ValueError(f"{changed.world_size} rank(s) do not spread evenly over {changed.nnodes} nodes")
        return changed

    def env(self, ckpt_dir: Path, loss_log: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CONFORMANCE_CKPT_DIR": str(node_dir(ckpt_dir, 0) if self.node_local else ckpt_dir),
                    "CONFORMANCE_TOTAL_STEPS": str(self.total_steps),
                    "CONFORMANCE_SAVE_EVERY": str(self.save_every),
                    "CONFORMANCE_SEED": str(self.seed),
                    "CONFORMANCE_LOSS_LOG": str(loss_log)})
        if self.cold is not None:
            env.update(cold_env(self.cold, ckpt_dir))
            if self.cold_fault is not None:
                env[f"CONFORMANCE_COLD_{self.cold_fault.kind.upper()}_AT"] = str(self.cold_fault.n)
        if self.resume_from is not None:
            env["CONFORMANCE_RESUME_FROM"] = str(self.resume_from)
        if self.hang_timeout is not None:
            env["CONFORMANCE_HANG_TIMEOUT"] = f"{self.hang_timeout:g}"
        if self.node_local:
            env["CONFORMANCE_SHARED_DIR"] = str(shared_dir(ckpt_dir))
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Writing .pyc files adds open/write calls to the first run only, which would shift the
        # per-thread syscall counts that crash points are addressed by.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def node_env(self, env: dict[str, str], ckpt_dir: Path, node: int) -> dict[str, str]:
        """`env` (this spec's, see `env`) as node `node` of a job gets it: with node-local storage,
        that node's own checkpoint directory."""
        if not self.node_local:
            return env
        return {**env, "CONFORMANCE_CKPT_DIR": str(node_dir(ckpt_dir, node))}

    def describe(self) -> str:
        ranks = f" world_size={self.world_size}" if self.is_job else ""
        ranks += f" nnodes={self.nnodes}" if self.nnodes > 1 else ""
        more = "".join(f" {k}={v}" for k, v in (("cold_fault", self.cold_fault), ("resume_from", self.resume_from))
                       if v is not None)
        return f"total_steps={self.total_steps} save_every={self.save_every} seed={self.seed}{ranks}{more}"


def node_dir(ckpt_dir: Path, node: int) -> Path:
    """Node `node`'s local disk, for a trainer with node-local storage: a directory under the
    checkpoint directory (so copies, traces and damage cover every node), which a lost node takes
    with it. Like a fresh node's disk it may not exist yet: the trainer creates it."""
    return ckpt_dir / f"node{node}"


def shared_dir(ckpt_dir: Path) -> Path:
    """The directory every node of a trainer with node-local storage shares (CONFORMANCE_SHARED_DIR)."""
    return ckpt_dir / "shared"


def cold_root(cold: str, ckpt_dir: Path) -> str:
    """The cold location of one checkpoint directory: beside it ("file"), or a prefix of its own."""
    if cold == "file":
        return f"{ckpt_dir}.cold"
    tag = hashlib.sha256(str(ckpt_dir).encode()).hexdigest()[:16]
    return f"{cold.split('://', 1)[1].rstrip('/')}/{tag}"


def copy_checkpoint_dir(src: Path, dst: Path, cold: str | None = None) -> None:
    """Copy a checkpoint directory, and its cold tier if it has one (a trainer with a cold tier
    resumes from both: a copy of the hot directory alone is a node loss)."""
    shutil.copytree(src, dst, symlinks=True)
    if cold is not None and cold != "file":
        import fsspec
        fs = fsspec.filesystem("s3")
        if fs.exists(cold_root(cold, src)):
            fs.copy(cold_root(cold, src), cold_root(cold, dst), recursive=True)
        return
    cold_src, cold_dst = Path(cold_root("file", src)), Path(cold_root("file", dst))
    if cold_src.is_dir():
        if cold_dst.exists():
            shutil.rmtree(cold_dst)
        shutil.copytree(cold_src, cold_dst, symlinks=True)


def remove_checkpoint_dir(ckpt: Path) -> None:
    """Remove a checkpoint directory and the file cold tier beside it."""
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(cold_root("file", ckpt), ignore_errors=True)


def cold_log(ckpt_dir: Path) -> Path:
    """Where the changes a run makes to its cold tier are recorded (coldstore.py)."""
    return ckpt_dir.with_name(ckpt_dir.name + ".cold-ops.jsonl")


def cold_env(cold: str, ckpt_dir: Path) -> dict[str, str]:
    return {"CONFORMANCE_COLD_URL": f"conformance-cold://{cold_root(cold, ckpt_dir)}",
            "CONFORMANCE_COLD_TARGET": "file" if cold == "file" else "s3",
            "CONFORMANCE_COLD_LOG": str(cold_log(ckpt_dir))}


@dataclasses.dataclass
class ProcessResult:
    """One trainer process, or one multi-rank job (torchrun and its ranks): `losses` is then the
    global curve (the mean of the ranks' local losses, at the steps every rank logged) and
    `rank_losses` each rank's own."""

    returncode: int
    losses: dict[int, float]
    stderr: str
    trace_text: str = ""
    killed: bool = False       # killed by the suite at a crash point
    seconds: float = 0.0
    overrun: str = ""          # why the suite stopped it early (a time limit), if it did
    stopped: str = ""          # a planned stop by the suite (after a step, after a grace period)
    rank_losses: tuple[dict[int, float], ...] = ()   # per rank, for a multi-rank job
    traces: dict[int, str] = dataclasses.field(default_factory=dict)   # rank -> strace text (jobs)
    exit_crash: str = ""       # "SIGABRT": it (every rank) logged its last step, then died by that signal

    @property
    def first_step(self) -> int | None:
        return min(self.losses) if self.losses else None

    def curves(self) -> dict[int | None, dict[int, float]]:
        """What to compare with a baseline: each rank's curve for a job (rank -> losses), else the
        one curve (None -> losses)."""
        return dict(enumerate(self.rank_losses)) if self.rank_losses else {None: self.losses}

    def rank_first_steps(self) -> dict[int, int | None]:
        """Rank -> the first step it logged (None: it logged nothing); empty for one process."""
        return {r: (min(l) if l else None) for r, l in enumerate(self.rank_losses)}

    def ranks_disagree(self) -> str | None:
        """For a job whose ranks resumed from different steps: which did what; else None."""
        firsts = {r: f for r, f in self.rank_first_steps().items() if f is not None}
        if len(set(firsts.values())) <= 1:
            return None
        return ", ".join(f"rank {r} from step {f - 1}" for r, f in sorted(firsts.items()))

    def resumed_from(self, spec: RunSpec) -> int:
        """The step this process resumed from (0: fresh); for a process that trained nothing,
        total_steps if it exited 0 (nothing left to do), else -1 (it did not start)."""
        if self.first_step is not None:
            return self.first_step - 1
        return spec.total_steps if self.returncode == 0 else -1


def rank_log(loss_log: Path, rank: int, world_size: int = 2) -> Path:
    """Where rank `rank` of a multi-rank job logs its local loss: `$CONFORMANCE_LOSS_LOG.rank{r}`
    (a one-rank job logs to `$CONFORMANCE_LOSS_LOG` itself, as WORLD_SIZE is 1)."""
    return loss_log if world_size == 1 else loss_log.with_name(f"{loss_log.name}.rank{rank}")


def remove_logs(loss_log: Path, world_size: int) -> None:
    """Delete a run's loss log(s), so a rerun into the same path starts empty (they are appended)."""
    loss_log.unlink(missing_ok=True)
    for r in range(world_size):
        rank_log(loss_log, r).unlink(missing_ok=True)


def read_job_losses(loss_log: Path, world_size: int) -> tuple[dict[int, float], tuple[dict[int, float], ...]]:
    """(global curve, per-rank curves) of a multi-rank job: the global loss of a step is the mean
    of the ranks' local losses, at the steps every rank logged."""
    ranks = tuple(read_losses(rank_log(loss_log, r, world_size)) for r in range(world_size))
    return mean_curve(ranks), ranks


def mean_curve(ranks: tuple[dict[int, float], ...]) -> dict[int, float]:
    """A job's global curve from its ranks' local ones: each step's mean, at the steps every rank logged."""
    common = set.intersection(*(set(l) for l in ranks)) if ranks else set()
    return {s: sum(l[s] for l in ranks) / len(ranks) for s in sorted(common)}


RESTART_KEY = "restart"   # a loss-log line {"restart": n} the suite writes before a rank restarted in place starts


def mark_restart(loss_log: Path, rank: int, world_size: int, attempt: int) -> None:
    """Before a worker torchrun restarted in place runs (its predecessor is dead), note in its
    loss log where the new attempt begins: readers of steps skip the line (read_losses)."""
    with open(rank_log(loss_log, rank, world_size), "a") as f:
        f.write(json.dumps({RESTART_KEY: attempt}) + "\n")


def read_attempts(loss_log: Path, rank: int, world_size: int) -> list[dict[int, float]]:
    """A rank's curve per attempt: workers torchrun restarted in place log to the same file, each
    attempt after a line mark_restart wrote."""
    attempts: list[dict[int, float]] = [{}]
    path = rank_log(loss_log, rank, world_size)
    for line in (path.read_text(errors="replace").splitlines() if path.exists() else []):
        try:
            rec = json.loads(line)
            if isinstance(rec, dict) and RESTART_KEY in rec:
                attempts.append({})
                continue
            attempts[-1][int(rec["step"])] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue
    return attempts


STATE_KEY = "state"   # a loss-log line's optional {"component": "digest", ...} (docs/running.md, "State digests")
RESTORED_KEY = "restored"   # on the first step k + 1 after a resume: the digests as it was about to train it


def loss_record(step: int, loss: float, *, metric: float | None = None, state: dict[str, str] | None = None,
                restored: dict[str, str] | None = None) -> dict:
    """One loss-log line as read_losses reads it: the step, its loss, and the optional metric, state
    digests and (on the first step after a resume) the digests right after set-up."""
    record = {"step": int(step), "loss": float(loss)}
    if metric is not None:
        record["metric"] = float(metric)
    if state:
        record[STATE_KEY] = dict(state)
    if restored:
        record[RESTORED_KEY] = dict(restored)
    return record


class Curve(dict):
    """A loss curve (step -> loss) and, where the trainer logs them, the digests of its state after
    each step (`states`: step -> component -> digest). Comparisons read the digests from here, so
    every check that compares curves compares states too (checks/digests.py)."""

    def __init__(self, *args, states: dict[int, dict[str, str]] | None = None, **kw):
        super().__init__(*args, **kw)
        self.states: dict[int, dict[str, str]] = states if states is not None else {}
        # (k, digests): the state right after a resumed process's set-up, before it trains step k + 1
        self.restored: tuple[int, dict[str, str]] | None = None


def read_losses(path: Path) -> Curve:
    """Parse the loss log; a torn last line (the process was killed mid-write) is ignored. A line's
    `state` object, if any, gives that step's state digests (non-string digests are read as text)."""
    losses = Curve()
    if not path.exists():
        return losses
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            step = int(rec["step"])
            losses[step] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue
        state = rec.get(STATE_KEY)
        if isinstance(state, dict) and state:
            losses.states[step] = {str(k): str(v) for k, v in state.items()}
        else:
            losses.states.pop(step, None)   # a step logged again (a restart in the same log) without digests
        restored = rec.get(RESTORED_KEY)
        if isinstance(restored, dict) and restored:
            losses.restored = (step - 1, {str(k): str(v) for k, v in restored.items()})
    return losses


class DirectorySnapshot:
    """A copy of a checkpoint directory taken before a delivery that may have to be retried."""

    def __init__(self, ckpt: Path):
        self.ckpt, self.copy = ckpt, ckpt.with_name(ckpt.name + "-before")
        remove_checkpoint_dir(self.copy)
        copy_checkpoint_dir(ckpt, self.copy)

    def restore(self) -> None:
        remove_checkpoint_dir(self.ckpt)
        copy_checkpoint_dir(self.copy, self.ckpt)

    def drop(self) -> None:
        remove_checkpoint_dir(self.copy)
