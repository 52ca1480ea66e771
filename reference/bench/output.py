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
    out += ["", "| ratio (higher is better, except memory) | median of rounds | spread (25th..75th pct) | target "
            "| verdict |", "|---|---:|---:|---:|:---:|"]
    for name, value in result["ratios"].items():
        t = result["targets"].get(name, {"target": "", "verdict": "", "spread": [value, value]})
        spread = f"{t['spread'][0]}..{t['spread'][1]}" if t["spread"][0] != t["spread"][1] else "(one value)"
        out.append(f"| `{name}` | {value} | {spread} | {t['target']} | {t['verdict']} |")
    if result["peak_extra_mem"]:
        out.append("")
        out.append("Peak extra RSS during a save (child process, 5 ms sampling): " + ", ".join(
            f"{v} {m['extra_mib']} MiB ({m['frac']:.3f} of the state)" for v, m in result["peak_extra_mem"].items())
            + ".")
    return "\n".join(out)
