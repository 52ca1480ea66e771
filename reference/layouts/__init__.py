"""Whole-state checkpoints: one file (`single_file`), or shards committed by an index (`sharded`, `index`).
Chained checkpoints live in `reference.chain`."""
