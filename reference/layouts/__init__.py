"""Whole-state checkpoints: one file (`single_file`), or shards committed by an index (`sharded`, `index`);
and the layout protocol the catalog, retention and the manager ask instead of branching on a layout (`kinds`),
with the defaults the layouts share (`base`). Chained checkpoints live in `reference.chain`; `replicated` is
only the old import path of a manager that is no layout (reference.multirank.replicated)."""
