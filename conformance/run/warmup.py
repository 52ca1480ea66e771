"""What a fork server does once, before it forks, so that none of its children does it again.

A child traced for a kill stops twice in strace for each of its syscalls, so work every child
repeats costs each trial: torch's lazy imports, the source lines torch's seeding call formats, CPU
detection, the bytecode of the trainer's module. None of it starts a thread or runs a tensor op,
so the children still start with no thread pool and no device state. The trainer's module is
imported first, as a fresh interpreter imports it; what a fresh interpreter imports only later
(torch's lazy modules, the launcher's) is loaded after it and kept out of sight until the trainer
imports it (deferred.py).
"""
from __future__ import annotations

import gc
import importlib
import linecache
import os
import sys
from collections.abc import Callable

from .deferred import Deferred

# torch imports these lazily in every child otherwise: dynamo on the first optimizer or DDP
# construction (about as long as importing torch), the profiler's CUPTI monitor on the first
# optimizer step and the serialization helpers on the first torch.save. A module this torch lacks
# is skipped.
LAZY_IMPORTS = ("torch._dynamo", "torch.profiler._cupti_monitor", "torch.utils.serialization")
# What this process loaded ahead of its trainer and keeps out of sight (inherited by its children).
DEFERRED = Deferred()
# The threads this process may fork with: those it has once torch is imported, plus those a
# preloaded module's import started while it loaded a BLAS or OpenMP runtime (numpy's OpenBLAS
# starts one worker per extra core, scipy's its own, lightning and transformers import scipy). These
# runtimes make their pools fork-safe themselves (pthread_atfork handlers). A thread beyond these (a
# Python thread, or a native one whose import loaded no such runtime) makes forking unsafe.
LIBRARY_THREADS: list[int] = []
# Shared objects whose thread pools are fork-aware, by name.
FORK_AWARE_POOLS = ("openblas", "libgomp", "libiomp", "libomp", "libmkl", "libblis")
# Why a preloaded module's threads were not taken as a pool's: (module, threads it started).
UNEXPLAINED_THREADS: list[tuple[str, int]] = []


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def mapped_objects() -> set[str]:
    """The shared objects this process has mapped, by path (a line's last field; anonymous
    mappings have none, or a bracketed name)."""
    with open("/proc/self/maps") as maps:
        last = (line.rsplit(None, 1)[-1] for line in maps)
        return {path for path in last if path.startswith("/") and ".so" in path}


def import_counting_threads(module: str) -> None:
    """Import `module`; the threads its import starts are allowed where it loaded a fork-aware
    pool runtime (LIBRARY_THREADS), and recorded as unexplained otherwise."""
    threads, objects = thread_count(), mapped_objects()
    importlib.import_module(module)
    started = thread_count() - threads
    if started <= 0:
        return
    if any(pool in os.path.basename(so) for so in mapped_objects() - objects for pool in FORK_AWARE_POOLS):
        LIBRARY_THREADS.append(started)
    else:
        UNEXPLAINED_THREADS.append((module, started))

# torch.manual_seed (and set_rng_state) queue each lazy device's seed with
# traceback.format_stack(), which reads every file on the stack through linecache, and checks each
# cached one with a stat: torch's own seeding modules, the fork server's and the trainer's, in every
# child again (9 files read, then 27 stats, for the reference trainer; runpy is frozen, never read).
SEEDING_MODULES = ("torch.random", "torch._compile", "torch._dynamo.eval_frame", "conformance.run.child",
                   "conformance.run.forked", "conformance.run.forkserver",
                   "__main__",   # conformance.run.forkserver run as a script, or a root of fork servers (forkroot)
                   *(f"torch.{device}{sub}" for device in ("cuda", "xpu", "mtia", "mps") for sub in ("", ".random")))


def warm_up(preload: list[str], later: list[str] = (), announce: Callable[[str], None] = lambda step: None) -> None:
    """Import torch and `preload` (the trainer's modules) as a fresh interpreter would, then load
    torch's lazy modules and `later` out of sight (deferred.py), then do the per-child work below
    once. `announce(what)` is called before each step ("importing torch", "importing M", ...): the
    fork server tells its client, so that a warm-up that ends or hangs is reported with its step."""
    announce("importing torch")
    import torch  # noqa: F401  (import only: no tensor op, no CUDA call before forking)
    LIBRARY_THREADS[:] = [thread_count()]
    # Bytecode may be cached for the trainer's module here, so children running it as __main__
    # skip compiling it; children never write bytecode (it would shift their write counts).
    sys.dont_write_bytecode = False
    for module in preload:
        announce(f"importing {module}")
        # A module that cannot be preloaded, whether it raises or exits (sys.exit, argparse), is
        # imported again by each child, as a fresh interpreter imports it: the child then ends as
        # that interpreter would, and the warm runner's verdict is the fresh runner's.
        try:
            import_counting_threads(module)
        except SystemExit as exc:
            print(f"forkserver: importing {module} exited with status {exit_status(exc)}; each trainer process "
                  "imports it again", file=sys.stderr)
        except Exception as exc:
            print(f"forkserver: cannot preload {module}: {exc!r}", file=sys.stderr)
    announce(f"loading {', '.join([*LAZY_IMPORTS, *later])} out of the trainer's sight")
    DEFERRED.load([*LAZY_IMPORTS, *later], lambda problem: print(f"forkserver: {problem}", file=sys.stderr))
    sys.dont_write_bytecode = True
    announce("doing once what each child would repeat")
    read_seeding_sources(preload)
    detect_cpu()
    for module in preload:
        keep_main_code(module)
    # Children's collections then skip the server's objects: no walk over torch's graph per
    # collection, and no copy-on-write of the pages that walk would touch.
    gc.collect()
    gc.freeze()


def exit_status(exc: SystemExit) -> int:
    """The status an interpreter exits with for this SystemExit (sys.exit(None): 0, a message: 1)."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def read_seeding_sources(preload: list[str]) -> None:
    """Fill linecache with the source of the modules on a seeding call's stack (those loaded), as
    entries linecache does not stat again (as it treats sources a loader gave it): the lines are
    those of the code the server loaded, which is the code its children run."""
    for name in (*SEEDING_MODULES, *preload):
        path = getattr(sys.modules.get(name) or DEFERRED.hidden.get(name, (None,))[0], "__file__", None)
        if path and path.endswith(".py") and linecache.getlines(path):
            size, _, lines, fullname = linecache.cache[path]
            linecache.cache[path] = (size, None, lines, fullname)


def detect_cpu() -> None:
    """torch's CPU detection (cpuinfo: /sys/devices/system/cpu and /proc/cpuinfo, 20 syscalls) runs
    on a process's first tensor op; asking for the CPU capability runs it here, once."""
    try:
        import torch.backends.cpu
        torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        pass


def keep_main_code(module: str) -> None:
    """runpy runs a `python -m` trainer as __main__ by asking the module's loader for its code
    again: a stat of the source and a read of its .pyc in every child (13 syscalls). The loaded
    module's loader answers that with the code it read here."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    loader = getattr(spec, "loader", None)
    real = getattr(loader, "get_code", None)
    if real is None:
        return
    try:
        code = real(module)
    except Exception:   # no code to keep (a namespace package, a loader without source): runpy asks as usual
        return
    if code is None:
        return

    def get_code(fullname: str):
        return code if fullname == module else real(fullname)

    loader.get_code = get_code


def huge_page_tunables(tunables: str | None) -> str:
    """The server's GLIBC_TUNABLES: the caller's, with malloc backing its heap by transparent huge
    pages (unless the caller chose otherwise). Every fork copies the page tables of the server's
    anonymous memory (hundreds of MB once torch is imported) and every child's exit tears them
    down, one entry per page: a 2 MiB page needs one where 4 KiB pages need 512, so both get
    cheaper with each part of the heap in huge pages (by how much: docs/benchmarks.md, "Measured
    by hand"). Only the server's process reads it; the children's environment is the trainer's,
    given with each request."""
    items = [t for t in (tunables or "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in items):
        items.append("glibc.malloc.hugetlb=1")
    return ":".join(items)
