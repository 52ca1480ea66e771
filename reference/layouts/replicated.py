"""Where `ReplicatedCheckpointManager` was published first, kept so that this import path goes on
working: it is a manager, not a layout, and lives in `reference.multirank.replicated` now."""
from ..multirank.replicated import ReplicatedCheckpointManager

__all__ = ["ReplicatedCheckpointManager"]
