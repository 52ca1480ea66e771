"""Chained checkpoints (full, incremental, differential): reading and verifying them (`read`), writing them
(`write`), what a chain needs and sweeping what no chain lists (`gc`), how one piece is stored (`codec`), and
the chained layout as the catalog sees it (`layout`)."""
