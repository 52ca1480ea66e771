"""What the training loop needs besides the checkpoint: the mid-epoch sampler (`data_order`), the SIGTERM flag
(`preemption`), and when to save (`triggers`)."""
