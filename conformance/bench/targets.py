"""What `python -m conformance.bench` is held to and how a result reads against it: the targets,
whether a value meets one, and the Markdown table of a result that `--update-readme` writes after
the marker line of docs/benchmarks.md.

Its own module because a target is a promise of the project's, not a way of measuring: the table
states each measure beside its target, so the two change together here, while measure.py only
times things and hands back numbers.
"""
from __future__ import annotations

from typing import Any

from ..model.settings import TOTAL_STEPS

# measure -> (how it compares, target), in the order of the table; the table prints the target as written here.
TARGETS = {"trial_vs_import": ("<=", 0.1), "script_trial_vs_import": ("<=", 0.1),
           "integrity_states_per_min": (">=", 1000),
           "power_loss_states_per_min": (">=", 1000), "ci_profile_seconds": ("<=", 90),
           "multirank_trial_vs_single": ("<=", 3.0), "multirank_ci_profile_seconds": ("<=", 300),
           "multinode_trial_vs_bare_pair": ("<=", 2.0), "digest_cost": ("<=", 0.05)}
# The trainer the multi-rank targets are stated for (multirank_*, multinode_*): measure.py runs it,
# and the table names it.
MULTIRANK_ADAPTER = "resume_conformance.fixtures.ddp_trainer:ADAPTER"
MARKER = "<!-- conformance-bench -->"   # the line of docs/benchmarks.md the table is written after


def met(key: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, target = TARGETS[key]
    return value <= target if op == "<=" else value >= target


def format_markdown(r: dict[str, Any], command: str) -> str:
    d = r["details"]
    ci = d.get("ci") or {}
    rows = [
        ("trial_vs_import", f"{r['trial_vs_import']:.3f}",
         f"warm trial {d['warm_trial_s'] * 1000:.0f} ms / bare `import torch` {d['bare_import_torch_s'] * 1000:.0f} ms "
         f"(fresh-interpreter trial {d['fresh_trial_s']:.2f} s, {d['fresh_vs_warm']:.0f}x the warm one)"),
        ("script_trial_vs_import", f"{r['script_trial_vs_import']:.3f}",
         f"the same trial with the trainer given as `python train.py`: {d['script_trial_s'] * 1000:.0f} ms"),
        ("integrity_states_per_min", f"{r['integrity_states_per_min']:.0f}",
         f"{d['crash_states']} crash states in {d['crash_states_seconds']:.1f} s, {d['state_workers']} at a time"),
        ("power_loss_states_per_min", f"{r['power_loss_states_per_min']:.0f}",
         f"{d['power_loss_states']} power-loss states (data and strict models) in {d['power_loss_seconds']:.1f} s"),
    ]
    if r["ci_profile_seconds"] is not None:
        rows.append(("ci_profile_seconds", f"{r['ci_profile_seconds']:.1f}",
                     f"{ci.get('summary', '')}; every fs op of a save covered: "
                     f"{'yes' if ci.get('covers_every_fs_op_of_a_save') else 'NO'} "
                     f"({ci.get('crash_states_checked', 0)} states / {ci.get('recorded_operations', 0)} recorded ops)"))
    else:
        rows.append(("ci_profile_seconds", "not run", "--no-ci"))
    lo, hi = d.get("multirank_trial_vs_single_spread") or (r["multirank_trial_vs_single"],) * 2
    rows.append(("multirank_trial_vs_single", f"{r['multirank_trial_vs_single']:.2f}",
                 f"2-rank trial ({d['multirank_trial_schedule']}) {d['multirank_trial_s'] * 1000:.0f} ms / "
                 f"single-process warm trial {d['warm_trial_s'] * 1000:.0f} ms, alternating; median of the "
                 f"per-pair ratios, spread {lo:.2f}..{hi:.2f}"))
    mci = d.get("multirank_ci") or {}
    rows.append(("multirank_ci_profile_seconds", "not run" if r["multirank_ci_profile_seconds"] is None
                 else f"{r['multirank_ci_profile_seconds']:.1f}",
                 f"`ci` against `{MULTIRANK_ADAPTER}` with `-n auto`: {mci.get('summary', '--no-ci')}"))
    lo, hi = d.get("multinode_trial_vs_bare_pair_spread") or (r["multinode_trial_vs_bare_pair"],) * 2
    rows.append(("multinode_trial_vs_bare_pair", f"{r['multinode_trial_vs_bare_pair']:.2f}",
                 f"2-node x 2-rank trial ({d['multinode_trial_schedule']}) {d['multinode_trial_s'] * 1000:.0f} ms / "
                 f"bare 4-rank torchrun pair (stopped after step {d['bare_pair_stop_after']}, resumed) "
                 f"{d['bare_pair_s'] * 1000:.0f} ms, alternating; median of the per-pair ratios, spread "
                 f"{lo:.2f}..{hi:.2f} ({d['multinode_trial_vs_single']:.1f}x the single-process warm trial)"))
    rows.append(("digest_cost", f"{r['digest_cost']:.4f}", f"state digest {d['digest_per_step_s'] * 1e3:.2f} "
                 f"ms x {TOTAL_STEPS // 3 + 1} (save steps, and after the resume) + a 14-step curve's comparison "
                 f"{d['digest_compare_per_curve_s'] * 1e3:.3f} ms x 3, per warm trial of {d['warm_trial_s'] * 1000:.0f} ms"))
    judged = r["targets_met"]
    lines = ["| measure | value | target | met | how |", "|---|---:|---:|:---:|---|"]
    by_key = {key: (value, how) for key, value, how in rows}
    for key, (op, target) in TARGETS.items():
        value, how = by_key[key]
        mark = "-" if judged[key] is None else "yes" if judged[key] else "no"
        lines.append(f"| `{key}` | {value} | {op} {target} | {mark} | {how} |")
    la = d["load_avg_before_after"]
    lines += ["", f"Command: `{command}` · {d['machine']['cpus']} cores · Python {d['machine']['python']} · "
                  f"torch {d['machine']['torch']} · medians of {d['repeats']} (fresh: {d['fresh_repeats']}) · "
                  f"1-minute load average {la[0]} before, {la[1]} after."]
    return "\n".join(lines)
