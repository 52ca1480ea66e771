"""What the training loop needs besides the checkpoint: the mid-epoch sampler (`data_order`), the SIGTERM flag
(`preemption`), and when to save (`triggers`: the public names, re-exported from `single`, one trigger and the
protocol every trigger follows, and `combined`, how triggers combine)."""
