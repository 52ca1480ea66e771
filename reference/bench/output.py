"""The benchmark's tables: plain text for a terminal, Markdown for the README."""
from __future__ import annotations

from typing import Any

from .constants import VARIANTS

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
        status = ""
        if t:
            spread = f" [{t['spread'][0]}..{t['spread'][1]}]" if t["spread"][0] != t["spread"][1] else ""
            verdict = {"met": "met", "missed": "MISSED"}.get(t["verdict"], f"inconclusive: {t.get('why', '')}")
            status = f"{spread}  (target {t['target']}: {verdict})"
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
           f"fp32 tensors; {result['repeats']} alternating rounds, each ratio judged on its per-round values (met "
           f"only if its whole spread meets the target); {result['cache']}; "
           f"1-minute load average {result['loadavg_1min'][0]} before, {result['loadavg_1min'][1]} after "
           f"(other work sharing the CPUs); priority: {result.get('priority', 'unchanged')}.",
           "",
           "| variant | median s | MiB/s | process CPU s |", "|---|---:|---:|---:|"]
    for v in VARIANTS:
        r = result["variants"][v]
        out.append(f"| {_LABELS[v]} | {r['median_s']:.3f} | {r['mib_per_s']:.0f} | {r['cpu_s']:.2f} |")
    out += ["", "| ratio | median of rounds | spread (25th..75th pct) | target "
            "| verdict |", "|---|---:|---:|---:|:---:|"]
    for name, value in result["ratios"].items():
        t = result["targets"].get(name, {"target": "", "verdict": "", "spread": [value, value]})
        if isinstance(value, str):     # not measured here, e.g. "needs zstandard"
            out.append(f"| `{name}` | - | - | - | {value} |")
            continue
        spread = f"{t['spread'][0]}..{t['spread'][1]}" if t["spread"][0] != t["spread"][1] else "(one value)"
        out.append(f"| `{name}` | {value} | {spread} | {t['target']} | {t['verdict']} |")
    chains = result.get("chains") or {}
    if chains:
        out += ["", chain_notes(chains)]
    if result["peak_extra_mem"]:
        out.append("")
        out.append("Peak extra RSS during a save (child process, 5 ms sampling): " + ", ".join(
            f"{v} {m['extra_mib']} MiB ({m['frac']:.3f} of the state)" for v, m in result["peak_extra_mem"].items())
            + ".")
    return "\n".join(out)


def chain_notes(c: dict[str, Any]) -> str:
    """What the chained-checkpoint ratios were measured on, in words."""
    frozen, sparse, comp = c["incremental_bytes_frac_frozen"], c["incremental_bytes_frac_sparse"], c.get("compression")
    levels = sorted({int(k.rsplit("level", 1)[1]) for k in comp if "_level" in k}) if comp else []
    rates = "; ".join(f"{d} level {lv}: shuffled {comp[f'{d}_level{lv}']['shuffled']['ratio']:.3f} at "
                      f"{comp[f'{d}_level{lv}']['shuffled']['mib_per_s']:.0f} MiB/s, plain zstd "
                      f"{comp[f'{d}_level{lv}']['plain']['ratio']:.3f} at "
                      f"{comp[f'{d}_level{lv}']['plain']['mib_per_s']:.0f} MiB/s"
                      for d in ("bf16", "fp32") for lv in levels)
    parts = [f"Chained checkpoints: frozen backbone ({frozen['frozen_param_frac']:.0%} of the parameters frozen, "
             f"AdamW on the rest) {frozen['incremental_bytes']} of {frozen['full_bytes']} bytes; with plain SGD "
             f"{frozen['sgd']['frac']:.3f}; an incremental save cannot write less than the trained parameters and "
             f"their optimizer state, (1 + s)·f / (1 + s·f) of a full save for a fraction f trained with s state "
             f"tensors per parameter (AdamW: s = 2, f = 0.1: 0.25).",
             f"Sparse: {sparse['rows_touched']} of {sparse['rows']} rows touched, {sparse['incremental_bytes']} of "
             f"{sparse['full_bytes']} bytes.",
             f"Compression of trained weights (zstd, byte planes compressed where they shrink): {rates}." if comp else
             "Compression: not measured (needs zstandard: pip install 'resume-conformance[compression]')."]
    for key, what in (("chain_restore_vs_full",
                       "chain of {chain_length}: {chain_restore_s:.3f} s vs full {full_restore_s:.3f} s"),
                      ("compressed_save_vs_plain", "compressed {compressed_save_s:.3f} s ({compressed_mib_per_s:.0f} MiB/s, "
                                                   "state {ratio_of_state:.3f}x smaller) vs plain {plain_save_s:.3f} s "
                                                   "({plain_mib_per_s:.0f} MiB/s)"),
                      ("async_stall_vs_copy", "save(blocking=False) blocks {async_save_blocks_s:.3f} s vs clone "
                                              "{cpu_copy_s:.3f} s (a sample sums {calls_per_sample} calls)"),
                      ("demotion_stall_vs_copy", "a step is blocked {blocked_ms:.3f} ms by the cold tier's background "
                                                 "upload and demotion vs clone {cpu_copy_s:.3f} s ({uploaded} "
                                                 "checkpoints uploaded)")):
        if key in c:
            parts.append(f"`{key}`: " + what.format(**c[key]) + ".")
    return " ".join(parts)
