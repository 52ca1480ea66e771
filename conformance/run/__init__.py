"""Starting and stopping trainer processes: the child entry points (`child`, `rank`), torchrun's command line
(`launch`), what every runner shares (`runners`), the fresh runner (`fresh`) and the warm one (`warm`): its
server (`forkserver`) and the suite's side of it (`forkclient`), what the server does once for its children
(`warmup`) and what it loads out of their sight until they import it (`deferred`), its children (`forked`),
which of two process identities a child gets (`identity`), `attach`, and `zygote`, which forks a warm job's
ranks; a job of several torchrun agents, one per node (`nodes`); how long a process may run (`watchdog`),
what /proc says its processes are doing (`proctree`) and where each was when it had to be stopped (`where`);
what ends the fresh processes when the suite ends (`guardian`); and the cold tier handed to a trainer
(`coldstore`)."""
