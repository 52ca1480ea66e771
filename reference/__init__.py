"""Reference checkpoint library: capture, write atomically, index, verify, load.

    payload = capture(model, optimizer, scheduler, global_step=step, epoch=e, batch_in_epoch=b,
                      loss_history=losses, data_order=sampler.state_dict())
    manager = CheckpointManager(run_dir, every_steps=100, keep_last=3)
    manager.save(payload)
    ...
    payload = manager.load_latest()          # verified, migrated, or None
    state = TrainState.from_payload(payload)
    state.restore(model, optimizer, scheduler)   # also restores every RNG
"""
from .chain.codec import Compression
from .chain.read import BrokenChainError
from .cold.fs import ColdStorageError
from .cold.store import ColdTierError
from .config import ManagerConfig
from .errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidIndexError,
    RNGRestoreError,
    SchemaError,
    UnsafeCheckpointError,
)
from .layouts.sharded import load_sharded, plan_shards, save_sharded, verify_sharded
from .layouts.single_file import load_file, save_file
from .lineage import NoSuchCheckpointError
from .loop.data_order import ResumableBatchSampler
from .loop.preemption import PreemptionGuard
from .loop.triggers import TriggerStateError, any_of, every_seconds, every_steps, forced_only, hybrid, on_metric
from .manager import CheckpointInfo, CheckpointManager, CheckpointSkippedWarning, latest_valid, list_checkpoints, load, verify
from .primitives.atomic import atomic_write, atomic_write_bytes, remove_stale_temps
from .primitives.schema import CURRENT_SCHEMA, CURRENT_VERSION, migrate, register_migration
from .rng import capture_rng, restore_rng
from .state import TrainState, capture


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("resume-conformance")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "BrokenChainError", "ColdStorageError", "ColdTierError", "NoSuchCheckpointError", "TriggerStateError",
    "any_of", "every_seconds", "every_steps", "forced_only", "hybrid", "on_metric", "CURRENT_SCHEMA", "CURRENT_VERSION",
    "CheckpointError", "Compression", "CheckpointInfo", "CheckpointManager",
    "CheckpointWriteError", "ManagerConfig", "PreemptionGuard",
    "CheckpointSkippedWarning", "CorruptCheckpointError", "IncompleteCheckpointError",
    "InvalidIndexError", "RNGRestoreError", "ResumableBatchSampler", "SchemaError", "TrainState",
    "UnsafeCheckpointError", "atomic_write", "atomic_write_bytes", "capture", "capture_rng",
    "latest_valid", "list_checkpoints", "load", "load_file", "load_sharded", "migrate",
    "plan_shards", "register_migration", "remove_stale_temps", "restore_rng", "save_file",
    "save_sharded", "verify", "verify_sharded",
]
