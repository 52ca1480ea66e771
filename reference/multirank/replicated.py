"""Node-local checkpoints, replicated to a peer node before the commit.

Each node of a job writes to its own local disk (CONFORMANCE_CKPT_DIR differs per node, as with
local NVMe), which a lost node takes with it. So every rank writes its whole state (model,
optimizer, shared and own state, its RNGs) to its node, and sends a copy to its peer: the rank
with the same local rank on the next node, which writes it as a replica. Only when every rank of
the job has written both does each node commit: its first rank writes the step's manifest (every
file's hash) and renames the staging directory to `step-N`. Any node's manifest therefore proves
that the whole step was written; a step is restorable while, for every rank, its own file or its
replica survives, verified against that manifest. A rank whose own copy is gone gets the bytes
from the peer that holds its replica (a collective), so a replaced node resumes like the others.

    step-<8 digits>/rank<r>.pt           rank r's state, on r's node
    step-<8 digits>/replica-rank<p>.pt   rank p's state, on the node after p's
    step-<8 digits>/manifest.json        written last, before the rename (the node's commit)

One node (no peer to replicate to) writes no replica: its disk is the only copy.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import names
from ..catalog import CheckpointInfo, CheckpointSkippedWarning, list_checkpoints
from ..distributed import MANIFEST, Loaded
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..primitives.atomic import atomic_write_bytes, fsync_dir
from ..primitives.encoding import from_torch_bytes, torch_bytes
from ..primitives.integrity import sha256_file
from ..retention import Candidate, check_keep_last, keep_set
from ..rng import capture_rng, restore_rng
from .staging import fresh_staging, sweep_staging

FORMAT = "reference-replicated/1"


def own_name(rank: int) -> str:
    return f"rank{rank}.pt"


def replica_name(rank: int) -> str:
    return f"replica-rank{rank}.pt"


def _write_synced(path: Path, data: bytes) -> None:
    """Write and fsync a file of the staging directory under its final name: the directory is the
    unit that is committed (renamed) once complete, so a file in it needs no temp name of its own
    (and a stable name is one a crash point can address in every run)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def committed_manifests(directory: Path) -> dict[int, dict[str, Any]]:
    """Step -> manifest, for the steps this node committed: of the step directories the catalog
    lists, those with a readable manifest of this format and step."""
    return manifests_of(list_checkpoints(directory, layout="sharded"))


def manifests_of(listed: list[CheckpointInfo]) -> dict[int, dict[str, Any]]:
    """committed_manifests of step directories already listed (retention lists once)."""
    out = {}
    for info in listed:
        try:
            manifest = json.loads((info.path / MANIFEST).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("step") == info.step:
            out[info.step] = manifest
    return out


class ReplicatedCheckpointManager:
    """Save and load a multi-node job's checkpoints on node-local disks, each rank's state
    replicated to a peer node before the commit (see the module docstring). The interface of
    DistributedCheckpointManager: `save`, `wait`, `load_latest`."""

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 2,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120), replicate: bool = True):
        check_keep_last(keep_last)
        self.directory, self.keep_last = Path(directory), keep_last
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.first_on_node = self.rank - self.rank % self.local
        # `replicate=False` keeps every rank's state on its own node only: a lost node loses it.
        hop = self.local if replicate else 0
        self.peer = (self.rank + hop) % self.world_size      # holds this rank's replica
        self.source = (self.rank - hop) % self.world_size    # whose replica this rank holds
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        if self.rank == self.first_on_node and not self.directory.is_dir():   # a fresh node's disk: made, durably
            self.directory.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.directory.parent)

    @property
    def replicated(self) -> bool:
        return self.peer != self.rank

    # -- save -------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             shared: dict[str, Any] | None = None, rank_state: dict[str, Any] | None = None) -> Path:
        """Write this rank's state and its peer's replica, then commit on every node once all
        ranks have written; returns this node's checkpoint directory."""
        blob = torch_bytes({"model": model.state_dict(), "optim": optimizer.state_dict() if optimizer else {},
                             "shared": shared or {}, "rank_state": rank_state or {}, "rng": capture_rng()})
        staging, final = self.directory / names.staging_name(step), self.directory / names.step_name(step)
        if self.rank == self.first_on_node:
            fresh_staging(staging)
        dist.barrier(group=self.group)
        _write_synced(staging / own_name(self.rank), blob)
        mine = {own_name(self.rank): list(sha256_file(staging / own_name(self.rank)))}
        if self.replicated:
            replica = self._exchange(blob, send_to=self.peer, receive_from=self.source)
            _write_synced(staging / replica_name(self.source), replica)
            mine[replica_name(self.source)] = list(sha256_file(staging / replica_name(self.source)))
        fsync_dir(staging)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)   # every rank has written both
        files = {name: h for part in everyone for name, h in part.items()}
        if self.rank == self.first_on_node:
            manifest = {"format": FORMAT, "step": step, "world_size": self.world_size, "local": self.local,
                        "files": files}
            atomic_write_bytes(staging / MANIFEST, json.dumps(manifest, sort_keys=True).encode(), sync_dir=True)
            if final.exists():
                shutil.rmtree(final)         # an older save of the same step (a rerun)
            os.rename(staging, final)        # this node's commit
            fsync_dir(self.directory)
            self._apply_retention(just_saved=step)
        return final

    def wait(self) -> None:
        """Saves here are synchronous: nothing is ever pending."""

    def _exchange(self, blob: bytes, *, send_to: int, receive_from: int) -> bytes:
        """Send `blob` to one rank and receive another's, as every rank does at once (a ring)."""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        incoming = torch.empty(int(sizes[receive_from].item()), dtype=torch.uint8)
        outgoing = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        ops = [dist.P2POp(dist.isend, outgoing, send_to, group=self.group),
               dist.P2POp(dist.irecv, incoming, receive_from, group=self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return incoming.numpy().tobytes()

    def _apply_retention(self, *, just_saved: int) -> None:
        """This node's first rank, after its commit: keep the newest keep_last committed steps
        (and always the one just saved); remove older ones and older staging directories."""
        listed = list_checkpoints(self.directory, layout="sharded")
        found = manifests_of(listed)
        keep = keep_set([Candidate(names.step_name(s), s) for s in found], keep_last=self.keep_last,
                        keep_best=None, anchor=names.step_name(just_saved))
        removed = sweep_staging(self.directory, older_than=just_saved)
        for info in listed:   # staging names are no step directories: the sweep changed nothing listed
            if info.step in found and info.path.name not in keep:
                shutil.rmtree(info.path)
                removed.append(info.path)
        if removed:
            fsync_dir(self.directory)

    # -- load -------------------------------------------------------------------------------
    def _verified(self, path: Path, name: str, manifest: dict[str, Any]) -> bool:
        expected = manifest["files"].get(name)
        try:
            return expected is not None and list(sha256_file(path / name)) == expected
        except OSError:
            return False

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Loaded | None:
        """Restore the newest step every rank can get a verified copy of its own state for (from
        its node, or from the peer holding its replica); None if there is none."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, committed_manifests(self.directory), group=self.group)
        manifests = {step: m for part in gathered for step, m in part.items()}
        for step in sorted(manifests, reverse=True):
            manifest = manifests[step]
            if manifest["world_size"] != self.world_size or manifest["local"] != self.local:
                continue
            path = self.directory / names.step_name(step)
            have = {"own": self._verified(path, own_name(self.rank), manifest),
                    "replica": self.replicated and self._verified(path, replica_name(self.source), manifest)}
            reports: list[Any] = [None] * self.world_size
            dist.all_gather_object(reports, have, group=self.group)
            missing = [r for r in range(self.world_size)
                       if not reports[r]["own"] and not reports[(r + self.peer - self.rank) % self.world_size]["replica"]]
            if missing:
                if self.rank == 0:
                    warnings.warn(f"skipping checkpoint of step {step}: no verified copy of rank(s) {missing}'s "
                                  "state survives on any node", CheckpointSkippedWarning, stacklevel=2)
                continue
            return self._restore(step, path, manifest, reports, model, optimizer)
        return None

    def _restore(self, step: int, path: Path, manifest: dict[str, Any], reports: list[dict[str, bool]],
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Loaded:
        # A rank without its own copy gets it from its peer, which sends the replica it holds.
        blob = (path / own_name(self.rank)).read_bytes() if reports[self.rank]["own"] else None
        needs_mine = not reports[self.source]["own"]   # the rank whose replica this rank holds lost its copy
        ops = []
        if needs_mine:
            replica = torch.frombuffer(bytearray((path / replica_name(self.source)).read_bytes()), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.isend, torch.tensor([replica.numel()], dtype=torch.int64), self.source,
                                  group=self.group))
        size = torch.zeros(1, dtype=torch.int64)
        if blob is None:
            ops.append(dist.P2POp(dist.irecv, size, self.peer, group=self.group))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        ops = []
        if needs_mine:
            ops.append(dist.P2POp(dist.isend, replica, self.source, group=self.group))
        if blob is None:
            incoming = torch.empty(int(size.item()), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, incoming, self.peer, group=self.group))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        if blob is None:
            blob = incoming.numpy().tobytes()
            if [len(blob), hashlib.sha256(blob).hexdigest()] != manifest["files"][replica_name(self.rank)]:
                raise CorruptCheckpointError(path, f"the replica of rank {self.rank} sent by rank {self.peer} does "
                                             "not match the manifest")
        state = from_torch_bytes(blob, path / own_name(self.rank))
        try:
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(state["optim"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise IncompleteCheckpointError(path, f"rank {self.rank}'s state does not fit the model: {exc}") from exc
        restore_rng(state["rng"], path=str(path / own_name(self.rank)))
        return Loaded(step, path, state["shared"], {self.rank: state["rank_state"]}, manifest["world_size"], self.rank)
