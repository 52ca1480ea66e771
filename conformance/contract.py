"""What a trainer computes for the suite, beside its losses: digests of its state after each step
(docs/running.md, "State digests"). A Python adapter's `ctx` offers the same as `ctx.state_digest`."""
from .model.digest import LeftOut, StateDigest, StateLeftOut, digest, rng_state, state_digest

__all__ = ["LeftOut", "StateDigest", "StateLeftOut", "digest", "rng_state", "state_digest"]
