"""`python -m reference.bench`: how much the library's guarantees cost, measured in one run.

Six variants (and one for reference) run on the same fp32, model-like state (a few large tensors, many small ones), the
variants alternating round by round so that background noise hits all of them alike; medians
are reported.

    raw_write      the tensors' bytes written with os.write to one file, then fsync
    torch_save     torch.save(payload, path), then fsync of the file
    atomic_save    reference.save_file(payload, path): tree digest, temp + hash-while-writing +
                   fsync + rename + directory fsync
    sharded_save   reference.save_sharded(payload, dir): default settings, every file hashed,
                   index.json committed last
    raw_read       read the raw file back into freshly allocated tensors, sha256 over its bytes
                   (the least a verified load must do: get the bytes into tensors, hash them)
    verified_load  reference.load_sharded(dir, verify=True): sizes and hashes checked before
                   anything is deserialized, weights_only=True
    raw_scan       (for reference, in no ratio) sha256 of the raw file through one reused 8 MiB
                   buffer: no tensors are built, so no fresh memory is faulted in

`payload` is reference.capture(state, global_step=1), the same object for every save variant.
Each round first deletes the previous round's files; before every timed step dirty data is
flushed (sync) and the disk is let go idle (no request in flight, so background discards of freed
blocks do not land in a timed step). Before every read the files to be read are
evicted from the page cache (posix_fadvise DONTNEED on each file, checked with mincore), so
reads are cold without dropping every other process's cache; if eviction cannot be confirmed,
/proc/sys/vm/drop_caches is tried, and failing that every read variant runs warm (files
pre-read) and the output says so.

Peak extra memory of a save is measured in a fresh child process per variant: the child builds
the state, records its resident set size (RSS), runs the save while a thread samples
/proc/self/statm every 5 ms, and reports max(sampled peak, ru_maxrss if the save raised it)
minus the baseline, as a fraction of the state's bytes.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .sharded import load_sharded, save_sharded
from .single_file import save_file
from .state import capture

SAVE_VARIANTS = ("raw_write", "torch_save", "atomic_save", "sharded_save")
READ_VARIANTS = ("raw_read", "verified_load", "raw_scan")
VARIANTS = SAVE_VARIANTS + READ_VARIANTS
MEMORY_VARIANTS = ("torch_save", "atomic_save", "sharded_save")
TARGETS = {"sharded_save_vs_raw": (">=", 0.9), "atomic_save_vs_torch_save": (">=", 1.0),
           "verified_load_vs_raw_read": (">=", 0.8), "peak_extra_mem_frac": ("<=", 0.10)}
_READ_CHUNK = 8 << 20
_SAMPLE_S = 0.005
_MARKER = "<!-- reference-bench -->"


# -- the state -------------------------------------------------------------------------------

def build_state(size_mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like fp32 state dict of about `size_mb` MiB: one large embedding, per layer
    four weight matrices plus biases and layer norms, and a head that tops the total up."""
    target = int(size_mb * (1 << 20))
    d = 128 if target < (16 << 20) else 512 if target < (1 << 30) else 1024
    g = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    total = 0

    def add(name: str, *shape: int) -> None:
        nonlocal total
        shapes.append((name, shape))
        n = 1
        for s in shape:
            n *= s
        total += 4 * n

    add("embed.weight", max(1, int(target * 0.2) // (4 * d)), d)
    layer = [("ln1.weight", (d,)), ("ln1.bias", (d,)), ("attn.qkv.weight", (3 * d, d)),
             ("attn.qkv.bias", (3 * d,)), ("attn.out.weight", (d, d)), ("attn.out.bias", (d,)),
             ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("mlp.up.weight", (4 * d, d)),
             ("mlp.up.bias", (4 * d,)), ("mlp.down.weight", (d, 4 * d)), ("mlp.down.bias", (d,))]
    layer_bytes = 4 * (12 * d * d + 13 * d)
    i = 0
    while total + layer_bytes + 4 * 2 * d <= target:
        for name, shape in layer:
            add(f"layers.{i}.{name}", *shape)
        i += 1
    add("ln_f.weight", d)
    add("ln_f.bias", d)
    rows = max(1, (target - total) // (4 * d))
    add("head.weight", rows, d)
    state = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(generator=g)  # in place: building never needs more than the state itself
        state[name] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")


# -- the variants ----------------------------------------------------------------------------

def raw_write(state: dict[str, torch.Tensor], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for t in state.values():
            view = _tensor_view(t)
            while view.nbytes:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(payload: dict[str, Any], path: Path) -> None:
    torch.save(payload, path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_scan(path: Path) -> tuple[None, str]:
    """For reference only: sha256 of the raw file read through one reused 8 MiB buffer, which
    builds no tensors (so pays no page faults for fresh memory)."""
    h = hashlib.sha256()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return None, h.hexdigest()


def raw_read(like: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Read the raw file into freshly allocated tensors shaped like `like`, hashing every byte."""
    h = hashlib.sha256()
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name, t in like.items():
            dst = torch.empty_like(t)
            view = _tensor_view(dst)
            pos = 0
            while pos < view.nbytes:
                n = f.readinto(view[pos:pos + _READ_CHUNK])
                if not n:
                    raise EOFError(f"{path}: short read")
                h.update(view[pos:pos + n])
                pos += n
            out[name] = dst
    return out, h.hexdigest()


# -- environment -----------------------------------------------------------------------------

def fs_type(path: Path) -> str:
    """Filesystem type of `path` from /proc/self/mountinfo (longest matching mount point)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                mount = fields[4].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, right.split()[0]
    return kind


def settle(directory: Path, timeout: float = 10.0) -> bool:
    """sync, then wait until the block device under `directory` has had no request in flight for
    30 ms (freed blocks are discarded in the background on `discard` mounts, and a timed step
    should not compete with the previous step's leftovers). True if it settled in time."""
    os.sync()
    dev = os.stat(directory).st_dev
    inflight = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/inflight")
    if not inflight.exists():
        return False
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        try:
            busy = any(int(x) for x in inflight.read_text().split())
        except (OSError, ValueError):
            return False
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return True
        time.sleep(0.01)
    return False


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _cached_pages(path: Path) -> int | None:
    """How many of the file's pages are in the page cache (mincore on an untouched private
    mapping, which faults nothing in), or None where that cannot be asked."""
    try:
        import ctypes
        import mmap
        size = path.stat().st_size
        if size == 0:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
                return None if rc != 0 else sum(b & 1 for b in vec)
            finally:
                del anchor
    except (OSError, AttributeError, ValueError, TypeError):
        return None


def evict(path: Path) -> bool:
    """Drop the (clean, fsynced) pages of `path`'s files from the page cache; True if confirmed."""
    ok = True
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # already durable: only makes sure no page is left dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            ok = False
        finally:
            os.close(fd)
        ok = ok and _cached_pages(p) == 0
    return ok


def _read_through(path: Path) -> None:
    buf = bytearray(_READ_CHUNK)
    for p in _files(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": round(mem / (1 << 30), 1) if mem else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "kernel": platform.release()}


# -- peak memory, measured in a child process ------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _memory_child(variant: str, size_mb: float, directory: Path) -> dict[str, Any]:
    state = build_state(size_mb)
    payload = capture(state, global_step=1)
    target = directory / f"mem-{variant}"
    run = {"torch_save": lambda: torch_save(payload, target),
           "atomic_save": lambda: save_file(payload, target),
           "sharded_save": lambda: save_sharded(payload, target),
           "raw_write": lambda: raw_write(state, target)}[variant]
    # Warm the code paths on a tiny payload so imports and lazy initialisation are not counted.
    tiny = capture(build_state(0.25, seed=1), global_step=1)
    warm = directory / f"mem-warm-{variant}"
    {"torch_save": lambda: torch_save(tiny, warm), "atomic_save": lambda: save_file(tiny, warm),
     "sharded_save": lambda: save_sharded(tiny, warm),
     "raw_write": lambda: raw_write(tiny["model"], warm)}[variant]()
    _remove(warm)
    del tiny
    import gc
    gc.collect()
    baseline = _rss_bytes()
    maxrss_before = _maxrss_bytes()
    peak = baseline
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_bytes())
            stop.wait(_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        stop.set()
        sampler.join()
    peak = max(peak, _rss_bytes())
    maxrss_after = _maxrss_bytes()
    if maxrss_after > maxrss_before:  # the kernel's own high-water mark moved during the save
        peak = max(peak, maxrss_after)
    _remove(target)
    nbytes = state_bytes(state)
    return {"variant": variant, "state_bytes": nbytes, "baseline_rss": baseline, "peak_rss": peak,
            "extra_bytes": peak - baseline, "extra_frac": (peak - baseline) / nbytes}


def measure_memory(variant: str, size_mb: float, directory: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "reference.bench", "--_memory-child", variant,
           "--size-mb", str(size_mb), "--dir", str(directory)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child for {variant} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the benchmark ---------------------------------------------------------------------------

def run_benchmark(size_mb: float, repeats: int, directory: Path, *, memory: bool = True,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    state = build_state(size_mb)
    payload = capture(state, global_step=1)
    nbytes = state_bytes(state)
    paths = {"raw_write": directory / "raw.bin", "torch_save": directory / "torch.pt",
             "atomic_save": directory / "atomic.pt", "sharded_save": directory / "sharded"}
    expected_raw = hashlib.sha256()
    for t in state.values():
        expected_raw.update(_tensor_view(t))
    expected_raw = expected_raw.hexdigest()

    saves: dict[str, Callable[[], Any]] = {
        "raw_write": lambda: raw_write(state, paths["raw_write"]),
        "torch_save": lambda: torch_save(payload, paths["torch_save"]),
        "atomic_save": lambda: save_file(payload, paths["atomic_save"]),
        "sharded_save": lambda: save_sharded(payload, paths["sharded_save"]),
    }
    reads: dict[str, Callable[[], Any]] = {
        "raw_read": lambda: raw_read(state, paths["raw_write"]),
        "raw_scan": lambda: raw_scan(paths["raw_write"]),
        "verified_load": lambda: load_sharded(paths["sharded_save"], verify=True),
    }
    read_sources = {"raw_read": paths["raw_write"], "verified_load": paths["sharded_save"]}

    # Untimed warm-up on a tiny state: imports, thread pools, lazy initialisation.
    warm_dir = directory / "warmup"
    warm_dir.mkdir()
    tiny_state = build_state(0.25, seed=1)
    tiny = capture(tiny_state, global_step=1)
    raw_write(tiny_state, warm_dir / "raw.bin")
    raw_read(tiny_state, warm_dir / "raw.bin")
    torch_save(tiny, warm_dir / "torch.pt")
    save_file(tiny, warm_dir / "atomic.pt")
    save_sharded(tiny, warm_dir / "sharded")
    load_sharded(warm_dir / "sharded", verify=True)
    shutil.rmtree(warm_dir)

    cache_mode = "evict"  # -> "drop_caches" -> "warm", whichever works
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    load_before = os.getloadavg()
    for r in range(repeats):
        # Rotate the order each round so no variant always runs first or last.
        save_order = SAVE_VARIANTS[r % len(SAVE_VARIANTS):] + SAVE_VARIANTS[:r % len(SAVE_VARIANTS)]
        read_order = READ_VARIANTS[r % len(READ_VARIANTS):] + READ_VARIANTS[:r % len(READ_VARIANTS)]
        for v in save_order:  # every save writes new files: nothing is replaced or freed mid-round
            _remove(paths[v])
        for v in save_order:
            settle(directory)
            c0, t0 = time.process_time(), time.perf_counter()
            saves[v]()
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            log(f"round {r + 1}/{repeats} {v:14s} {times[v][-1]:.3f} s")
        for v in read_order:
            os.sync()
            if cache_mode == "evict" and not all(evict(src) for src in read_sources.values()):
                cache_mode = "drop_caches"
            if cache_mode == "drop_caches" and not drop_caches():
                cache_mode = "warm"
            if cache_mode == "warm":  # cannot read cold here: every read variant runs warm instead
                for src in read_sources.values():
                    _read_through(src)
            settle(directory)
            c0, t0 = time.process_time(), time.perf_counter()
            result = reads[v]()
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            log(f"round {r + 1}/{repeats} {v:14s} {times[v][-1]:.3f} s")
            if v in ("raw_read", "raw_scan") and result[1] != expected_raw:
                raise RuntimeError("raw read returned different bytes than were written")
            if v == "verified_load" and not torch.equal(result["model"]["head.weight"], state["head.weight"]):
                raise RuntimeError("verified load returned different tensors than were saved")
            del result
    for p in paths.values():
        _remove(p)

    mb = nbytes / (1 << 20)
    variants = {}
    for v in VARIANTS:
        med = statistics.median(times[v])
        variants[v] = {"median_s": round(med, 4), "mib_per_s": round(mb / med, 1),
                       "times_s": [round(t, 4) for t in times[v]],
                       "cpu_s": round(statistics.median(cpu[v]), 4)}
    load_after = os.getloadavg()
    med = {v: variants[v]["median_s"] for v in VARIANTS}
    ratios: dict[str, Any] = {
        "sharded_save_vs_raw": round(med["raw_write"] / med["sharded_save"], 3),
        "atomic_save_vs_torch_save": round(med["torch_save"] / med["atomic_save"], 3),
        "verified_load_vs_raw_read": round(med["raw_read"] / med["verified_load"], 3),
    }
    mem: dict[str, Any] = {}
    if memory:
        for v in MEMORY_VARIANTS:
            os.sync()
            mem[v] = measure_memory(v, size_mb, directory)
            log(f"memory {v:14s} +{mem[v]['extra_bytes'] / (1 << 20):.1f} MiB "
                f"({mem[v]['extra_frac']:.3f} of the state)")
        ratios["peak_extra_mem_frac"] = round(max(mem["atomic_save"]["extra_frac"],
                                                  mem["sharded_save"]["extra_frac"]), 4)
    targets = {}
    for name, (op, bound) in TARGETS.items():
        if name in ratios:
            value = ratios[name]
            targets[name] = {"target": f"{op} {bound}", "met": value >= bound if op == ">=" else value <= bound}
    return {
        "size_mb": size_mb, "state_bytes": nbytes, "num_tensors": len(state),
        "largest_tensor_bytes": max(t.numel() * 4 for t in state.values()),
        "repeats": repeats,
        "cache": {"evict": "cold reads: the files' pages were evicted before every read (fadvise DONTNEED, "
                           "confirmed with mincore)",
                  "drop_caches": "cold reads: page cache dropped before every read",
                  "warm": "WARM reads: the page cache could not be dropped here, so every read variant "
                          "ran with its files cached"}[cache_mode],
        "filesystem": fs_type(directory), "machine": machine_info(),
        # Other processes competing for the CPUs: 1-minute load average before and after the
        # timed rounds (on 2 cores, above ~1 the CPU-heavier variants are slowed the most).
        "loadavg_1min": [round(load_before[0], 2), round(load_after[0], 2)],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "variants": variants, "ratios": ratios, "targets": targets,
        "peak_extra_mem": {v: {"extra_mib": round(m["extra_bytes"] / (1 << 20), 1),
                               "frac": round(m["extra_frac"], 4)} for v, m in mem.items()},
    }


# -- output ----------------------------------------------------------------------------------

_LABELS = {
    "raw_write": "raw write + fsync (os.write, one file)",
    "torch_save": "torch.save + fsync",
    "atomic_save": "save_file (atomic single file, digest)",
    "sharded_save": "save_sharded (atomic, hashed, 2 shards + meta)",
    "raw_read": "raw read + sha256 (into fresh tensors)",
    "raw_scan": "(info) raw read + sha256, one reused buffer",
    "verified_load": "load_sharded(verify=True)",
}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'variant':50s} {'median s':>9s} {'MiB/s':>8s} {'CPU s':>7s}"]
    for v in VARIANTS:
        r = result["variants"][v]
        lines.append(f"{_LABELS[v]:50s} {r['median_s']:9.3f} {r['mib_per_s']:8.1f} {r['cpu_s']:7.3f}")
    lines.append("")
    for name, value in result["ratios"].items():
        t = result["targets"].get(name)
        status = f"  (target {t['target']}: {'met' if t['met'] else 'MISSED'})" if t else ""
        lines.append(f"{name:28s} {value}{status}")
    for v, m in result["peak_extra_mem"].items():
        lines.append(f"peak extra memory {v:14s} {m['extra_mib']} MiB ({m['frac']} of the state)")
    lines.append(f"state: {result['state_bytes'] / (1 << 20):.1f} MiB in {result['num_tensors']} fp32 tensors, "
                 f"{result['repeats']} rounds, {result['cache']}, filesystem {result['filesystem']}, "
                 f"load average {result['loadavg_1min'][0]} -> {result['loadavg_1min'][1]} "
                 f"on {result['machine']['cpus']} CPUs, priority: {result.get('priority', 'unchanged')}")
    return "\n".join(lines)


def format_markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    out = [f"Command: `{command}` &middot; date {result['date']} &middot; machine: {m['cpus']} cores "
           f"({m['cpu_model']}), {m['memory_gib']} GiB RAM, {result['filesystem']} &middot; torch {m['torch']}, "
           f"Python {m['python']}. State: {result['state_bytes'] / (1 << 20):.0f} MiB in {result['num_tensors']} "
           f"fp32 tensors; median of {result['repeats']} alternating rounds; {result['cache']}; "
           f"1-minute load average {result['loadavg_1min'][0]} before, {result['loadavg_1min'][1]} after "
           f"(other work sharing the CPUs); priority: {result.get('priority', 'unchanged')}.",
           "",
           "| variant | median s | MiB/s | process CPU s |", "|---|---:|---:|---:|"]
    for v in VARIANTS:
        r = result["variants"][v]
        out.append(f"| {_LABELS[v]} | {r['median_s']:.3f} | {r['mib_per_s']:.0f} | {r['cpu_s']:.2f} |")
    out += ["", "| ratio (higher is better, except memory) | measured | target | met |", "|---|---:|---:|:---:|"]
    for name, value in result["ratios"].items():
        t = result["targets"].get(name, {"target": "", "met": None})
        out.append(f"| `{name}` | {value} | {t['target']} | {'yes' if t['met'] else 'no'} |")
    if result["peak_extra_mem"]:
        out.append("")
        out.append("Peak extra RSS during a save (child process, 5 ms sampling): " + ", ".join(
            f"{v} {m['extra_mib']} MiB ({m['frac']:.3f} of the state)" for v, m in result["peak_extra_mem"].items())
            + ".")
    return "\n".join(out)


def update_readme(readme: Path, section: str) -> None:
    """Replace what follows the marker line, up to the next heading, with `section`."""
    lines = readme.read_text().splitlines()
    start = lines.index(_MARKER)
    end = start + 1
    while end < len(lines) and not lines[end].startswith("#"):
        end += 1
    lines[start + 1:end] = ["", *section.splitlines(), ""] if end < len(lines) else ["", *section.splitlines()]
    readme.write_text("\n".join(lines) + "\n")


def set_priority(nice: int) -> str:
    """Apply `nice` to this process and, where the kernel groups processes by session (autogroup,
    which makes plain nice values matter only within a session), to its autogroup. The autogroup
    setting outlives the process, so the previous value is put back at exit."""
    done = []
    try:
        os.nice(nice - os.nice(0))
        done.append(f"nice {os.nice(0)}")
    except OSError as exc:
        done.append(f"nice unchanged ({exc.strerror})")
    try:
        with open("/proc/self/autogroup") as f:
            previous = int(f.read().split("nice")[1])
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        done.append(f"autogroup nice {nice}")
    except (OSError, IndexError, ValueError):
        return ", ".join(done)

    def restore() -> None:
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
            f.write(str(previous))

    atexit.register(restore)
    return ", ".join(done)


def _default_parent() -> Path:
    return Path.cwd()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (a temp dir is made inside it and removed afterwards; "
                             "default: the current directory, so its disk is measured, not a tmpfs)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--nice", type=int, default=0, metavar="N",
                        help="run at this nice value, and (Linux, root) with this autogroup nice, so "
                             "other sessions' processes take less of the CPUs; negative raises the "
                             "priority (default 0: unchanged). Reported in the output.")
    parser.add_argument("--markdown", action="store_true", help="also print the README section")
    parser.add_argument("--update-readme", type=Path, default=None, metavar="README",
                        help=f"replace the section after the {_MARKER} line of README with the table")
    parser.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.size_mb <= 0:
        parser.error("--repeats must be >= 1 and --size-mb > 0")

    priority = set_priority(args.nice) if args.nice else "unchanged"
    if args.memory_child:
        print(json.dumps(_memory_child(args.memory_child, args.size_mb, args.dir)))
        return 0

    parent = args.dir if args.dir is not None else _default_parent()
    parent.mkdir(parents=True, exist_ok=True)
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs"):
        print(f"warning: {parent} is on {kind}; the numbers measure memory, not a disk", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix=".reference-bench-", dir=parent))
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        result = run_benchmark(args.size_mb, args.repeats, work, memory=not args.no_memory, log=log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m reference.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    result["command"] = command.strip()
    result["priority"] = priority
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    if args.markdown:
        print(format_markdown(result, result["command"]), file=sys.stderr if args.json else sys.stdout)
    if args.update_readme is not None:
        update_readme(args.update_readme, format_markdown(result, result["command"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
