"""The warm single-process crash trial of this checkout against an older checkout's, alternating
trial by trial (`python -m conformance.bench --ab OLD_CHECKOUT`): a regression shows as one ratio."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    """The median wall time of `repeats` calls of fn(), and every time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def interleaved_trials(first, second, repeats: int) -> tuple[list[float], list[float]]:
    """`repeats` trials of each (`first.once()`, `second.once()`: seconds), alternating (ABBA...),
    so that the machine's background load hits both alike; round r's two times form one pair."""
    a, b = [], []
    for r in range(repeats):
        if r % 2:
            b.append(second.once())
            a.append(first.once())
        else:
            a.append(first.once())
            b.append(second.once())
    return a, b


def spread(values: list[float]) -> tuple[float, float]:
    """25th and 75th percentile."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(sorted(values), n=4, method="inclusive")
    return q1, q3


# -- A/B against another checkout -------------------------------------------------------------------
# Run by each side's interpreter with its checkout as the working directory and first on sys.path,
# so it must work with that checkout's own API: this one's TrialTimer (in subpackages or flat), or the layout before it
# (conformance.checks/trials/suite modules, as at af8020e). Protocol on stdin/stdout, JSON lines:
#     <- {"ready": true, "point": ..., "conformance": path}      (baseline recorded, one warm-up trial paid)
#     -> "trial"   <- {"s": seconds}                              (one warm crash trial)
#     -> EOF: the session is closed and the worker exits.
AB_WORKER = r"""
import json, os, sys, tempfile, time
from pathlib import Path
root = sys.argv[1]
sys.path.insert(0, root)
out = sys.stdout
sys.stdout = sys.stderr   # only the protocol on stdout
import conformance
tmp = tempfile.TemporaryDirectory(prefix="conformance-ab-")
try:
    from conformance.bench.measure import TrialTimer      # subpackages (this layout)
except ImportError:
    try:
        from conformance.bench import TrialTimer          # the flat layout with TrialTimer (b81d3f1 and before)
    except ImportError:
        TrialTimer = None
if TrialTimer is not None:
    timer = TrialTimer("warm", Path(tmp.name))
    once, point, close = timer.once, str(timer.point), timer.close
else:   # the layout before conformance/checks/ (af8020e)
    from conformance import checks
    from conformance.adapters import resolve
    from conformance.crash import CrashPoint
    from conformance.strategies import _ordered_fs
    from conformance.suite import SEED, TOTAL_STEPS
    from conformance.trials import RunSpec, WarmRunner
    session = checks.Session(resolve(None, None), Path(tmp.name) / "warm", runner=WarmRunner())
    spec = RunSpec(TOTAL_STEPS, 3, SEED)
    point_ = CrashPoint("fs", _ordered_fs(session.baseline(spec), True)[0])
    checks.run_trial(session, spec, (point_,))   # warm-up: the fork server's imports are paid once
    def once():
        start = time.perf_counter()
        checks.run_trial(session, spec, (point_,))
        return time.perf_counter() - start
    point, close = str(point_), session.close
def say(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()
say({"ready": True, "point": point, "conformance": os.path.dirname(os.path.abspath(conformance.__file__))})
try:
    for line in sys.stdin:
        if line.strip() == "trial":
            say({"s": once()})
finally:
    close()
    tmp.cleanup()
"""


class ABSide:
    """One side of an A/B: a worker process running AB_WORKER in `root` (a checkout)."""

    def __init__(self, root: Path, *, worker: str = AB_WORKER, python: str = sys.executable):
        self.root = Path(root).resolve()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                 if p])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.log = tempfile.TemporaryFile(mode="w+")   # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen([python, "-c", worker, str(self.root)], cwd=self.root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.ready = self._reply()
        if not self.ready.get("ready"):
            raise RuntimeError(f"{self.root}: the A/B worker did not start: {self.ready}")

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:   # it closed its stdout: it is exiting (a killed one is gone within the minute too)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)
            self.log.seek(0)
            raise RuntimeError(f"{self.root}: the A/B worker exited {self.proc.returncode}:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def once(self) -> float:
        self.proc.stdin.write("trial\n")
        self.proc.stdin.flush()
        return float(self._reply()["s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)   # SIGKILLed: gone within the minute, or TimeoutExpired names it
        self.log.close()


def ab(old_root: Path, rounds: int, *, new_root: Path | None = None, worker: str = AB_WORKER) -> dict[str, Any]:
    """The warm single-process crash trial of `new_root` (this checkout) against `old_root`'s,
    alternating (see interleaved_trials): the new/old ratio per pair, its median and spread."""
    new_root = Path(new_root or Path(__file__).resolve().parent.parent)
    load_before = os.getloadavg()[0]
    new = old = None
    try:
        new = ABSide(new_root, worker=worker)
        old = ABSide(old_root, worker=worker)
        new_all, old_all = interleaved_trials(new, old, rounds)
    finally:
        for side in (new, old):
            if side is not None:
                side.close()
    ratios = [n / o for n, o in zip(new_all, old_all)]
    return {
        "new_vs_old": statistics.median(ratios),
        "new_vs_old_spread": list(spread(ratios)),
        "ratio_of_medians": statistics.median(new_all) / statistics.median(old_all),
        "new_trial_s": statistics.median(new_all), "new_trial_spread_s": list(spread(new_all)),
        "old_trial_s": statistics.median(old_all), "old_trial_spread_s": list(spread(old_all)),
        "details": {
            "new": {"root": str(new.root), "conformance": new.ready.get("conformance"), "point": new.ready.get("point")},
            "old": {"root": str(old.root), "conformance": old.ready.get("conformance"), "point": old.ready.get("point")},
            "rounds": rounds, "pair_ratios": ratios, "all_times_s": {"new": new_all, "old": old_all},
            "load_avg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    }


def format_ab(r: dict[str, Any]) -> str:
    d = r["details"]
    lo, hi = r["new_vs_old_spread"]
    nlo, nhi = r["new_trial_spread_s"]
    olo, ohi = r["old_trial_spread_s"]
    la = d["load_avg_before_after"]
    return "\n".join([
        (f"warm crash trial, new/old: {r['new_vs_old']:.3f} (median of {d['rounds']} alternating pairs, "
        f"spread {lo:.3f}..{hi:.3f}; ratio of the medians {r['ratio_of_medians']:.3f})"),
        (f"  new {r['new_trial_s'] * 1000:.0f} ms ({nlo * 1000:.0f}..{nhi * 1000:.0f}) at {d['new']['root']} "
        f"[{d['new']['point']}]"),
        (f"  old {r['old_trial_s'] * 1000:.0f} ms ({olo * 1000:.0f}..{ohi * 1000:.0f}) at {d['old']['root']} "
        f"[{d['old']['point']}]"),
        "  new s: " + " ".join(f"{t:.3f}" for t in d["all_times_s"]["new"]),
        "  old s: " + " ".join(f"{t:.3f}" for t in d["all_times_s"]["old"]),
        "  new/old per pair: " + " ".join(f"{x:.3f}" for x in d["pair_ratios"]),
        f"  1-minute load average {la[0]} before, {la[1]} after",
    ])
