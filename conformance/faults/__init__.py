"""Planning and landing faults: Hypothesis strategies for crash points (`strategies`), one kill trial
(`scenario`), delivering a fault exactly where it was planned and proving it landed (`delivery`), how far a job's
syscall counts drift between delivery attempts (`shifts`), storage errors and SIGTERM (`injection`), and damage done
to a committed checkpoint (`corrupt`)."""
