"""The cold tier: the store and its commit marker (`store`), the manager's upload, retain and demote pass
(`demotion`), and opening an fsspec URL so an unreachable store fails fast (`fs`)."""
