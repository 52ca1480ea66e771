"""Whole-state checkpoints: one file (`single_file`), or shards committed by an index (`sharded`, `index`);
a multi-node job's node-local checkpoints, each rank's state replicated to a peer node (`replicated`).
Chained checkpoints live in `reference.chain`."""
