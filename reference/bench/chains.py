"""Chained checkpoints: bytes an incremental save writes, what a chain costs to restore, what
compression gains and costs, and how long an async save blocks.

    incremental_bytes_frac_frozen   bytes an incremental save writes / a full save's, after one
                                    AdamW step of a model whose backbone (90% of the parameters)
                                    is frozen; also measured with plain SGD (details)
    incremental_bytes_frac_sparse   same, a model dominated by an embedding table trained with
                                    SparseAdam, 1% of its rows touched between the saves
    chain_restore_vs_full           time to load the 10th checkpoint of an incremental chain /
                                    to load a full checkpoint of the same state (cold reads)
    compress_ratio_bf16 / _fp32     raw bytes / stored bytes of trained weights (an MLP trained
                                    with AdamW), at the default level
    shuffle_gain                    shuffled+zstd ratio / plain zstd ratio, same bytes and level
                                    (the smaller of bf16's and fp32's)
    compressed_save_vs_plain        compressed full save / uncompressed full save, same state,
                                    both fsynced
    async_stall_vs_copy             time save(blocking=False) blocks / time of a plain CPU copy of
                                    the state (tensor.clone() of every tensor)

Byte fractions and compression ratios are exact counts (one value each); the three time ratios
are judged on per-round values, variants alternating within a round, like the rest of the
benchmark.
"""
from __future__ import annotations

import functools
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..chain import codec
from ..chain import read as chain
from ..manager import CheckpointManager, load
from ..state import capture
from .constants import MAX_INNER_CALLS, MIN_SAMPLE_S, TARGETS
from .disk import evict, settle
from .judge import RatioJudgement, judge, per_round
from .workload import build_state, state_bytes

DEFAULT_LEVEL = codec.Compression.level   # the dataclass default; building one would need zstandard
NEEDS_ZSTANDARD = "needs zstandard"      # a compression row where the 'compression' extra is missing
COMPRESSION_ROWS = ("compress_ratio_bf16", "compress_ratio_fp32", "shuffle_gain", "compressed_save_vs_plain")


def _saved_bytes(run: Path, steps: list[Callable[[], dict]], **kw) -> list[int]:
    """Bytes each save wrote, for payloads made by `steps` (each trains, then captures)."""
    manager = CheckpointManager(run, keep_last=None, **kw)
    out = []
    for i, make in enumerate(steps):
        manager.save(make(), step=i + 1, force=True)
        out.append(manager.last_save.written_bytes)
    shutil.rmtree(run)
    return out


def frozen_backbone_fraction(directory: Path, optimizer: str) -> dict[str, Any]:
    """A 9-layer 512-wide backbone (frozen) and a trained head of 10% of the parameters."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(9)]).requires_grad_(False)
    head = torch.nn.Linear(512, 512)
    model = torch.nn.Sequential(backbone, head)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-3)
    x = torch.randn(32, 512)

    def step(k: int) -> dict:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return capture(model, opt, global_step=k)
    frozen = sum(p.numel() for p in backbone.parameters())
    total = frozen + sum(p.numel() for p in params)
    full, incremental = _saved_bytes(directory / f"frozen-{optimizer}", [lambda: step(1), lambda: step(2)],
                                     strategy="incremental")
    return {"frac": incremental / full, "full_bytes": full, "incremental_bytes": incremental,
            "frozen_param_frac": round(frozen / total, 4), "optimizer": optimizer}


def sparse_embedding_fraction(directory: Path, rows: int = 200_000, dim: int = 64) -> dict[str, Any]:
    torch.manual_seed(0)
    table = torch.nn.Embedding(rows, dim, sparse=True)
    head = torch.nn.Linear(dim, 1)
    sparse_opt = torch.optim.SparseAdam(list(table.parameters()), lr=1e-2)
    dense_opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    model = torch.nn.ModuleDict({"table": table, "head": head})
    g = torch.Generator().manual_seed(1)

    def step(k: int) -> dict:
        idx = torch.randperm(rows, generator=g)[:rows // 100]          # 1% of the rows
        loss = head(table(idx)).pow(2).mean()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        return capture(model, sparse_opt, global_step=k, extra={"dense_optimizer": dense_opt.state_dict()})
    full, incremental = _saved_bytes(directory / "sparse", [lambda: step(1), lambda: step(2)],
                                     strategy="incremental")
    return {"frac": incremental / full, "full_bytes": full, "incremental_bytes": incremental,
            "rows": rows, "rows_touched": rows // 100}


def trained_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An MLP trained with AdamW for 300 steps on a regression task (not fresh initial values), in
    `dtype`."""
    return {k: v.to(dtype, copy=True) for k, v in _trained_fp32().items()}


@functools.cache
def _trained_fp32() -> dict[str, torch.Tensor]:
    """Trained once per process: every dtype's weights are these, converted (training is fp32)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(2)
    target = torch.nn.Linear(256, 256)
    for _ in range(300):
        x = torch.randn(64, 256, generator=g)
        loss = (model(x) - target(x).detach()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compression_ratios(levels: tuple[int, ...] = (DEFAULT_LEVEL, 3)) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        weights = trained_weights(dtype)
        raw = sum(t.numel() * t.element_size() for t in weights.values())
        for level in levels:
            row = {}
            for shuffle in (True, False):
                comp = codec.Compression(level=level, shuffle=shuffle)
                start, stored = time.perf_counter(), 0
                for t in weights.values():
                    stored += codec.encode(memoryview(t.view(torch.uint8).reshape(-1).numpy()), dtype=t.dtype,
                                           compression=comp)[1]["stored_bytes"]
                seconds = time.perf_counter() - start
                row["shuffled" if shuffle else "plain"] = {"ratio": raw / stored,
                                                           "mib_per_s": raw / (1 << 20) / seconds}
            row["shuffle_gain"] = row["shuffled"]["ratio"] / row["plain"]["ratio"]
            out[f"{name}_level{level}"] = row
        out[f"{name}_bytes"] = raw
    return out


def _timed_rounds(variants: dict[str, Callable[[], Any]], repeats: int, *, before: Callable[[str], None],
                  log: Callable[[str], None], inner: int = 1) -> dict[str, list[float]]:
    """Every variant once per round, the order rotated each round; `before(v)` runs untimed. With
    `inner`, a sample is the sum of that many timed calls (each after its untimed `before`), so
    that an operation much shorter than MIN_SAMPLE_S still gives samples long enough to judge."""
    names = list(variants)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(repeats):
        for v in names[r % len(names):] + names[:r % len(names)]:
            total = 0.0
            for _ in range(inner):
                before(v)
                t0 = time.perf_counter()
                variants[v]()
                total += time.perf_counter() - t0
            times[v].append(total)
            log(f"chains round {r + 1}/{repeats} {v:18s} {total:.3f} s" + (f" ({inner} calls)" if inner > 1 else ""))
    return times


def chain_restore(directory: Path, size_mb: float, repeats: int, log) -> tuple[list[float], dict[str, Any]]:
    """An embedding-dominated state saved as a 10-checkpoint incremental chain (1% of the rows
    change between saves), and once as a full checkpoint of the 10th state."""
    state = build_state(size_mb, seed=3)
    run, full = directory / "chain", directory / "full"
    manager = CheckpointManager(run, strategy="incremental", full_every=100, keep_last=None)
    g = torch.Generator().manual_seed(4)
    embed = state["embed.weight"]
    for k in range(1, 11):
        rows = torch.randperm(embed.shape[0], generator=g)[:max(1, embed.shape[0] // 100)]
        embed[rows] += 0.01
        state["head.weight"][0] += 0.01
        payload = capture(state, global_step=k)
        manager.save(payload, step=k, force=True)
    CheckpointManager(full, strategy="full", keep_last=None).save(payload, step=10, force=True)
    tenth, full_path = run / chain.manifest_name(10), full / chain.manifest_name(10)
    depth = len(chain.read_chain(tenth))
    times = _timed_rounds({"chain_restore": lambda: load(tenth), "full_restore": lambda: load(full_path)},
                          repeats, before=lambda v: (evict(run), evict(full), settle(directory)), log=log)
    check = load(tenth)["model"]
    if not torch.equal(check["embed.weight"], embed):
        raise RuntimeError("the chain restored a different table than was saved")
    shutil.rmtree(run)
    shutil.rmtree(full)
    return per_round(times["chain_restore"], times["full_restore"]), {
        "chain_length": depth, "chain_restore_s": statistics.median(times["chain_restore"]),
        "full_restore_s": statistics.median(times["full_restore"]),
        "shortest_median_s": min(statistics.median(t) for t in times.values())}


def compressed_save(directory: Path, size_mb: float, repeats: int, log) -> tuple[list[float], dict[str, Any]]:
    state = build_state(size_mb, seed=5)
    payload = capture(state, global_step=1)
    runs = {"compressed_save": directory / "compressed", "plain_save": directory / "plain"}

    def save(v: str) -> None:
        CheckpointManager(runs[v], strategy="full", keep_last=None,
                          compression=DEFAULT_LEVEL if v == "compressed_save" else None).save(payload, step=1, force=True)

    def before(v: str) -> None:
        shutil.rmtree(runs[v], ignore_errors=True)
        settle(directory)
    times = _timed_rounds({v: (lambda v=v: save(v)) for v in runs}, repeats, before=before, log=log)
    stored = sum(p.stat().st_size for p in (runs["compressed_save"] / "pieces").iterdir())
    for p in runs.values():
        shutil.rmtree(p, ignore_errors=True)
    nbytes = state_bytes(state)
    return per_round(times["compressed_save"], times["plain_save"]), {
        "compressed_save_s": statistics.median(times["compressed_save"]),
        "plain_save_s": statistics.median(times["plain_save"]),
        "compressed_mib_per_s": nbytes / (1 << 20) / statistics.median(times["compressed_save"]),
        "plain_mib_per_s": nbytes / (1 << 20) / statistics.median(times["plain_save"]),
        "ratio_of_state": nbytes / stored, "level": DEFAULT_LEVEL,
        "shortest_median_s": min(statistics.median(t) for t in times.values())}


def async_stall(directory: Path, size_mb: float, repeats: int, log) -> tuple[list[float], dict[str, Any]]:
    state = build_state(size_mb, seed=6)
    payload = capture(state, global_step=1)
    manager = CheckpointManager(directory / "async", strategy="full", keep_last=1)
    copies: list[Any] = []

    def before(v: str) -> None:
        manager.wait()           # the previous background save is not part of any timing
        copies.clear()
        settle(directory)
    variants = {"async_save_blocks": lambda: manager.save(payload, step=1, force=True, blocking=False),
                "cpu_copy": lambda: copies.append({k: t.clone() for k, t in state.items()})}
    # One copy of the state takes well under MIN_SAMPLE_S: a sample sums enough of them. Each call
    # also waits (untimed) for the previous background save, so a tiny state is capped at
    # MAX_INNER_CALLS: its samples stay short and its verdict inconclusive, as they should.
    before("cpu_copy")
    t0 = time.perf_counter()
    variants["cpu_copy"]()
    inner = max(1, min(MAX_INNER_CALLS, math.ceil(1.5 * MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-3))))
    times = _timed_rounds(variants, repeats, before=before, log=log, inner=inner)
    manager.close()
    shutil.rmtree(directory / "async", ignore_errors=True)
    return per_round(times["async_save_blocks"], times["cpu_copy"]), {
        "async_save_blocks_s": statistics.median(times["async_save_blocks"]),
        "cpu_copy_s": statistics.median(times["cpu_copy"]), "calls_per_sample": inner,
        "shortest_median_s": min(statistics.median(t) for t in times.values())}


def run_chain_benchmark(size_mb: float, repeats: int, directory: Path, *,
                        log: Callable[[str], None] = lambda s: None) -> tuple[dict[str, float], dict[str, RatioJudgement],
                                                                              dict[str, Any]]:
    """(ratios, judgements, details) for the chained-checkpoint keys."""
    ratios: dict[str, float] = {}
    judged: dict[str, RatioJudgement] = {}
    details: dict[str, Any] = {}

    def exact(name: str, value: float) -> None:
        op, bound = TARGETS[name]
        judged[name] = judge([value], op, bound)
        ratios[name] = judged[name].median

    def timed(name: str, values: list[float], info: dict[str, Any]) -> None:
        op, bound = TARGETS[name]
        judged[name] = judge(values, op, bound, shortest_median_s=info.pop("shortest_median_s"))
        ratios[name] = judged[name].median
        details[name] = info

    frozen = frozen_backbone_fraction(directory, "adamw")
    details["incremental_bytes_frac_frozen"] = {**frozen, "sgd": frozen_backbone_fraction(directory, "sgd")}
    exact("incremental_bytes_frac_frozen", frozen["frac"])
    # The table is 51 MiB (200k rows) at the default size, smaller for a quick run.
    sparse = sparse_embedding_fraction(directory, rows=max(4000, min(200_000, int(size_mb * 200))))
    details["incremental_bytes_frac_sparse"] = sparse
    exact("incremental_bytes_frac_sparse", sparse["frac"])
    log("chains: byte fractions done")
    compress = codec.zstandard_available()
    if compress:
        comp = compression_ratios()
        details["compression"] = comp
        exact("compress_ratio_bf16", comp[f"bf16_level{DEFAULT_LEVEL}"]["shuffled"]["ratio"])
        exact("compress_ratio_fp32", comp[f"fp32_level{DEFAULT_LEVEL}"]["shuffled"]["ratio"])
        exact("shuffle_gain", min(comp[f"{d}_level{DEFAULT_LEVEL}"]["shuffle_gain"] for d in ("bf16", "fp32")))
        log("chains: compression ratios done")
    else:    # the rows stay, marked, so a reader sees what was not measured and why
        ratios.update(dict.fromkeys(COMPRESSION_ROWS, NEEDS_ZSTANDARD))
        log("chains: compression rows skipped (needs zstandard: pip install 'resume-conformance[compression]')")
    timed("chain_restore_vs_full", *chain_restore(directory, size_mb, repeats, log))
    if compress:
        timed("compressed_save_vs_plain", *compressed_save(directory, size_mb, repeats, log))
    timed("async_stall_vs_copy", *async_stall(directory, size_mb, repeats, log))
    from .tiers import demotion_stall
    timed("demotion_stall_vs_copy", *demotion_stall(directory, size_mb, repeats, log))
    return ratios, judged, details
