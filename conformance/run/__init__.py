"""Starting and stopping trainer processes: the child entry points (`child`, `rank`), torchrun's command line
(`launch`), the warm runner (`forkserver`, what it does once for its children (`warmup`), its children
(`forked`), a root that forks fork servers for harnesses that start many suite processes (`forkroot`),
`attach`, and `zygote`, which forks a warm job's ranks), the runners themselves (`runners`), a job of
several torchrun agents, one per node (`nodes`), how long a process may run and what /proc says it is doing
(`watchdog`, `proctree`), and the cold tier handed to a trainer (`coldstore`)."""
