"""Multi-rank checkpoints beside `reference.distributed` (a DCP job's manager): the staging directory a
multi-rank save is written in before its rename commits it, and the sweep of those a dead save left
(`staging`), which both managers use; and a multi-node job's node-local checkpoints, each rank's state
replicated to a peer node (`replicated`)."""
