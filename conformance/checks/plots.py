"""Loss-curve plots for resume mismatches: baseline and resumed curves, crash and resume points.

matplotlib is optional (`pip install resume-conformance[plots]`); without it no plot is written
and the failure message says why.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ..model.crash import Schedule, format_schedule


def plot_name(check: str, adapter_name: str, schedule: Schedule | None, extra: str = "") -> str:
    parts = [check, adapter_name, format_schedule(schedule) if schedule is not None else "", extra]
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", "-".join(p for p in parts if p)).strip("_")[:150] + ".png"


def plot_resume(path: Path, *, title: str, baseline: dict[int, float],
                resumed: list[tuple[str, dict[int, float]]], crashes: list[tuple[str, float]],
                resumes: list[int]) -> Path | str:
    """Write the plot to `path`; returns the path, or the reason no plot was written.

    `crashes` are (label, x position: the last step logged before the kill + 0.5); `resumes`
    are the steps each resumed process started from."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written: matplotlib is not installed (pip install resume-conformance[plots])"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        finite = [v for curve in [baseline, *(losses for _, losses in resumed)] for v in curve.values()
                  if math.isfinite(v)]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        pad = (high - low) * 0.08 or 1.0
        top = high + pad     # where non-finite losses are drawn, labelled, so a blow-up is visible
        steps = sorted(baseline)
        ax.plot(steps, [baseline[s] if math.isfinite(baseline[s]) else float("nan") for s in steps], "-o",
                color="black", lw=2, ms=4, label="uninterrupted baseline", zorder=3)
        markers = "s^vD<>"
        for i, (label, losses) in enumerate(resumed):
            xs = sorted(losses)
            if not xs:
                continue
            bad = [s for s in xs if not math.isfinite(losses[s])]
            line, = ax.plot(xs, [losses[s] if s not in bad else float("nan") for s in xs],
                            "--" + markers[i % len(markers)], ms=5, lw=1.2,
                            label=label + (f" ({len(bad)} non-finite)" if bad else ""), zorder=4)
            for s in bad:
                ax.plot([s], [top], marker="X", ms=10, color=line.get_color(), zorder=5, clip_on=False)
                ax.annotate(str(losses[s]), (s, top), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=8, color=line.get_color())
        ax.set_ylim(low - pad, top + pad * 1.5)
        for label, x in crashes:
            ax.axvline(x, color="tab:red", ls=":", lw=1.5)
            ax.annotate(f"kill at {label}", (x, 0.0), xycoords=("data", "axes fraction"), rotation=90,
                        va="bottom", ha="right", fontsize=8, color="tab:red")
        for r in resumes:
            if r >= 0:
                ax.axvline(r + 0.5, color="tab:blue", ls="-.", lw=1.2)
                ax.annotate(f"resumed from step {r}", (r + 0.5, 0.0), xycoords=("data", "axes fraction"),
                            rotation=90, va="bottom", ha="left", fontsize=8, color="tab:blue")
        ax.set_xlabel("global step")
        ax.set_ylabel("loss")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
