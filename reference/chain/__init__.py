"""Chained checkpoints (full, incremental, differential): reading, verifying and sweeping them (`read`), writing
them (`write`), and how one piece is stored (`codec`)."""
