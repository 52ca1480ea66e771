"""Multi-rank checkpoints on torch.distributed.checkpoint (DCP), plus what DCP lacks.

DCP plans and writes every rank's shards (`__{rank}_0.distcp`) and rank 0's `.metadata`, and
reshards on load; `get_state_dict`/`set_state_dict` turn DDP, FSDP2 and optimizers into its
state dicts. This module adds the commit protocol around it:

    save:   every rank writes into `.staging-step-N/` (DCP, files fsynced), plus its own
            `rank{r}.pt` (per-rank RNG and data order) and rank 0 `shared.pt`; every rank hashes
            its files and the sha256s are gathered to rank 0, which fsyncs the directory, writes
            `manifest.json` last, renames the staging directory to `step-N` (the commit point)
            and fsyncs the run directory. A barrier, then rank 0 applies retention.
    load:   rank 0 lists `step-N` directories by step number; every rank verifies its share of
            the newest one's files against the manifest, and all ranks agree (one all-reduce)
            before DCP reads a byte; a failing checkpoint is skipped for the next older one.

    async:  with `async_save=True`, `save` writes the small per-rank files, hands the shards to
            DCP's `async_save` (a CPU copy of the state, then a background thread writes; its
            collectives run on a group of their own) and returns; `wait()` finishes the write
            and then hashes, commits and applies retention as above. Until then the step is not
            committed: `latest` never sees it and retention never counts it. `save` and
            `load_latest` wait for a pending save first.

Nothing is pickled: DCP holds tensors only, `rank{r}.pt` and `shared.pt` load with
`weights_only=True`, and every file's hash is checked before DCP unpickles `.metadata`.
Collectives run on a gloo group of the manager's own with a timeout, so a rank that died
mid-save gives every other rank an error instead of a hang.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import names
from .catalog import CheckpointSkippedWarning, list_checkpoints
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, write_error
from .multirank.staging import fresh_staging, sweep_staging
from .primitives.atomic import atomic_write_bytes, fsync_dir
from .primitives.encoding import torch_bytes
from .primitives.integrity import sha256_file
from .primitives.loading import safe_torch_load
from .retention import Candidate, check_keep_last, keep_set
from .rng import capture_rng, restore_rng

MANIFEST = "manifest.json"
FORMAT = "reference.distributed/1"


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What load_latest restored: the step, rank 0's shared state and every saving rank's own state
    (a resharding trainer redistributes them; `rank_state` is None for a rank the saving job did
    not have, e.g. after resharding 1 -> 2)."""

    step: int
    path: Path
    shared: dict[str, Any]
    rank_states: dict[int, dict[str, Any]]
    saved_world_size: int
    rank: int

    @property
    def rank_state(self) -> dict[str, Any] | None:
        return self.rank_states.get(self.rank)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


_torch_bytes = torch_bytes   # the name fixtures/broken/ import


def _load_safe(path: Path) -> Any:
    """One of this manager's own files (`rank{r}.pt`, `shared.pt`), verified, loaded onto the CPU."""
    return safe_torch_load(path, map_location="cpu")


def read_manifest(directory: Path) -> dict[str, Any]:
    """The commit record of a committed checkpoint; CheckpointError if absent or malformed."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise IncompleteCheckpointError(directory, f"no {MANIFEST}: never committed") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(path, f"unreadable: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(files, dict)
            or not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("world_size"), int)
            or any(not isinstance(v, list) or len(v) != 2 for v in files.values())):
        raise CorruptCheckpointError(path, f"not a {FORMAT} manifest")
    for name in files:
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..", MANIFEST):
            raise CorruptCheckpointError(path, f"unsafe file name {name!r}")
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any], files: list[str]) -> None:
    """Size and sha256 of each named file against the manifest."""
    for name in files:
        size, digest = manifest["files"][name]
        try:
            actual = sha256_file(directory / name)
        except FileNotFoundError:
            raise IncompleteCheckpointError(directory / name, "listed in the manifest but missing") from None
        if actual != (size, digest):
            raise CorruptCheckpointError(directory / name, f"size/sha256 {actual[0]}/{actual[1][:12]} differ "
                                                           f"from the manifest's {size}/{digest[:12]}")


def committed_steps(directory: Path) -> list[tuple[int, Path]]:
    """Committed-looking checkpoints (`step-N` directories, as the catalog lists them), newest first."""
    return [(info.step, info.path) for info in reversed(list_checkpoints(directory, layout="sharded"))]


@dataclasses.dataclass
class _Pending:
    """An async save whose shards are still being written in the background."""

    step: int
    staging: Path
    final: Path
    written: list[str]
    future: Any          # concurrent.futures.Future of DCP's async_save


class DistributedCheckpointManager:
    """Save and load a multi-rank job's checkpoints under `directory` (shared by every rank).

    Call save/load_latest/wait on every rank, in the same order: they are collective. With
    `async_save`, call `wait()` before the step after a save is done (or whenever the save must
    be durable) and before exiting."""

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 2,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120), async_save: bool = False):
        check_keep_last(keep_last)
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.timeout = timeout
        self.rank, self.world_size = _rank(), _world()
        # A group of our own: its timeout bounds every commit collective, and the trainer's own
        # collectives never interleave with ours.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # DCP's background thread runs its own collectives: on a group of its own, so that they
        # never interleave with the commit collectives the main thread runs on `group`.
        self.async_save = async_save
        self.async_group = dist.new_group(backend="gloo", timeout=timeout) if async_save and self.group else None
        self.pending: _Pending | None = None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- collectives -----------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.group is not None:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)

    def _gather(self, obj: Any) -> list[Any] | None:
        if self.group is None:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # -- save -------------------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        return self.directory / names.step_name(step)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             shared: dict[str, Any] | None = None, rank_state: dict[str, Any] | None = None) -> Path:
        """Save and commit step `step`. `shared` (rank 0's: schedulers, counters, loss history) and
        `rank_state` (this rank's: data position, its own generators) must be weights_only-safe;
        every rank's RNGs are captured too. Returns the checkpoint's directory, committed on
        return, or with `async_save` once `wait()` returns."""
        self.wait()
        final = self.path_for(step)
        staging = self.directory / names.staging_name(step)
        self._prepare(staging)
        if self.async_save:
            self.pending = self._start_async(step, staging, final, model, optimizer, shared, rank_state)
            return final
        written = self._write(staging, model, optimizer, shared, rank_state)
        self._finish(step, staging, final, written)
        return final

    def wait(self) -> Path | None:
        """Finish the pending async save, if any: its shards written, then hashed, committed and
        retention applied. Returns the directory committed, or None when nothing was pending."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except OSError as exc:
            raise write_error(pending.staging, exc) from exc
        written = pending.written + [e.name for e in os.scandir(pending.staging)
                                     if e.name.startswith(f"__{self.rank}_")]
        self._finish(pending.step, pending.staging, pending.final, written)
        return pending.final

    def _finish(self, step: int, staging: Path, final: Path, written: list[str]) -> None:
        files = self._gather_hashes(staging, written)
        if self.rank == 0:
            self._commit(staging, final, step, files)
        self._barrier()                  # every rank knows the commit happened
        if self.rank == 0:
            self.apply_retention(just_saved=final)

    def _start_async(self, step: int, staging: Path, final: Path, model, optimizer, shared, rank_state) -> _Pending:
        """This rank's own small files now; its shards by DCP in the background (from a CPU copy
        taken before this returns, so training may go on)."""
        written = self._write_own(staging, shared, rank_state)
        try:
            future = dcp.async_save(self._state(model, optimizer), process_group=self.async_group,
                                    storage_writer=dcp.FileSystemWriter(staging, sync_files=True,
                                                                        single_file_per_rank=True))
        except OSError as exc:
            raise write_error(staging, exc) from exc
        return _Pending(step, staging, final, written, future)

    @staticmethod
    def _state(model, optimizer) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
        return {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}

    def _prepare(self, staging: Path) -> None:
        if self.rank == 0:
            fresh_staging(staging)
        self._barrier()

    def _write(self, staging: Path, model, optimizer, shared, rank_state) -> list[str]:
        """This rank's files in the staging directory, each fsynced: its DCP shard (DCP plans and
        writes), its own state, and on rank 0 `.metadata` and the shared state."""
        try:
            dcp.save(self._state(model, optimizer), storage_writer=dcp.FileSystemWriter(
                staging, sync_files=True, single_file_per_rank=True), process_group=self.group)
        except OSError as exc:
            raise write_error(staging, exc) from exc
        return self._write_own(staging, shared, rank_state) + [e.name for e in os.scandir(staging)
                                                               if e.name.startswith(f"__{self.rank}_")]

    def _write_own(self, staging: Path, shared, rank_state) -> list[str]:
        """`rank{r}.pt` (this rank's state and RNGs) and on rank 0 `shared.pt`; `.metadata` is
        rank 0's to list (DCP writes it)."""
        files = {f"rank{self.rank}.pt": torch_bytes({"rank_state": rank_state or {}, "rng": capture_rng()})}
        if self.rank == 0:
            files["shared.pt"] = torch_bytes(shared or {})
        try:
            for name, data in files.items():
                atomic_write_bytes(staging / name, data, sync_dir=False)
        except OSError as exc:
            raise write_error(staging, exc) from exc
        return list(files) + ([".metadata"] if self.rank == 0 else [])

    def _gather_hashes(self, staging: Path, written: list[str]) -> dict[str, list] | None:
        """Every rank hashes its own files; rank 0 gets all of them (None elsewhere). The gather
        is also what makes rank 0 wait until every rank has finished writing."""
        gathered = self._gather({name: list(sha256_file(staging / name)) for name in written})
        return {name: h for part in gathered for name, h in part.items()} if gathered is not None else None

    def _commit(self, staging: Path, final: Path, step: int, files: dict[str, list]) -> None:
        """Rank 0: fsync the staging directory, write the manifest last, rename to the final name
        (the commit point), fsync the run directory."""
        manifest = {"format": FORMAT, "step": step, "world_size": self.world_size, "files": files}
        try:
            fsync_dir(staging)
            atomic_write_bytes(staging / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
            if final.exists():
                self._remove(final)          # an older save of the same step (a rerun)
            os.rename(staging, final)
            fsync_dir(self.directory)
        except OSError as exc:
            raise write_error(final, exc) from exc

    def _remove(self, path: Path) -> None:
        """Un-commit first (the manifest), then delete, so a crash midway leaves nothing that looks
        committed."""
        (path / MANIFEST).unlink(missing_ok=True)
        fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)

    def apply_retention(self, *, just_saved: Path) -> list[Path]:
        """Rank 0, after the commit barrier: keep what retention's one rule keeps (the newest
        keep_last committed checkpoints, and always `just_saved`); remove the other committed
        ones, and staging directories older than it."""
        removed: list[Path] = []
        if self.keep_last is None:
            return removed
        found = committed_steps(self.directory)
        keep = keep_set([Candidate(path.name, step) for step, path in found], keep_last=self.keep_last,
                        keep_best=None, anchor=just_saved.name)
        for _step, path in found:
            if path.name not in keep:
                self._remove(path)
                removed.append(path)
        removed += sweep_staging(self.directory, older_than=names.step_of(just_saved.name))
        if removed:
            fsync_dir(self.directory)
        return removed

    # -- load -------------------------------------------------------------------------------
    def _verify_collectively(self, path: Path) -> dict[str, Any] | None:
        """Every rank checks its share of the files; the checkpoint is usable only if all agree."""
        problem = None
        manifest = None
        try:
            manifest = read_manifest(path)
            files = sorted(manifest["files"])
            verify_files(path, manifest, files[self.rank::self.world_size])
            if manifest["files"].keys() < {".metadata", "shared.pt"}:
                raise IncompleteCheckpointError(path, "the manifest lists no .metadata or shared.pt")
        except CheckpointError as exc:
            problem = exc
        if not self._all_ok(problem is None):
            if problem is not None:
                warnings.warn(f"skipping checkpoint: {problem}", CheckpointSkippedWarning, stacklevel=3)
            elif self.rank == 0:
                warnings.warn(f"skipping checkpoint {path}: another rank found it damaged",
                              CheckpointSkippedWarning, stacklevel=3)
            return None
        return manifest

    def _rank_states(self, path: Path, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Every saving rank's own state (verified with the rest of the checkpoint)."""
        return {r: _load_safe(path / f"rank{r}.pt") for r in range(manifest["world_size"])
                if f"rank{r}.pt" in manifest["files"]}

    def _candidates(self) -> list[tuple[int, Path]]:
        return self._broadcast(committed_steps(self.directory) if self.rank == 0 else None)

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Loaded | None:
        """Restore the newest checkpoint that every rank verified, or return None (nothing usable).
        Rank 0's listing decides the candidates for all ranks, so every rank loads the same step."""
        self.wait()
        for step, path in self._candidates():
            manifest = self._verify_collectively(path)
            if manifest is None:
                continue
            state = self._state(model, optimizer)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=self.group)
            set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                           optim_state_dict=state.get("optim", {}))
            shared = _load_safe(path / "shared.pt")
            saved = self._rank_states(path, manifest)
            # Each rank's own generators, when the job has the same ranks; after resharding the
            # trainer decides (its own generators travel in rank_state).
            if self.rank in saved and manifest["world_size"] == self.world_size:
                restore_rng(saved[self.rank]["rng"], path=str(path / f"rank{self.rank}.pt"))
            return Loaded(step, path, shared, {r: s["rank_state"] for r, s in saved.items()},
                          manifest["world_size"], self.rank)
        return None
