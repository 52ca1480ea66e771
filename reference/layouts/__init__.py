"""Whole-state checkpoints: one file (`single_file`), or shards committed by an index (`sharded`, `index`);
a multi-node job's node-local checkpoints, each rank's state replicated to a peer node (`replicated`); and the
layout protocol the catalog, retention and the manager ask instead of branching on a layout (`kinds`), with
the defaults the layouts share (`base`).
Chained checkpoints live in `reference.chain`."""
