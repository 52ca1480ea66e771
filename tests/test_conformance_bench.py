"""The speed benchmark's report (the measurements themselves are run by hand: timed tests on
shared machines would be noise)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conformance.bench import ab as bench_ab
from conformance.bench import measure as bench
from conformance.bench import targets
from conformance.report.readme import MarkerMissing, replace_section


def _result(trial=0.08, states=1200.0, ci=60.0, power=1500.0, ranks=2.5, ranks_ci=None, nodes=2.3):
    return {"trial_vs_import": trial, "integrity_states_per_min": states, "ci_profile_seconds": ci,
            "power_loss_states_per_min": power, "script_trial_vs_import": trial,
            "multirank_trial_vs_single": ranks, "multirank_ci_profile_seconds": ranks_ci,
            "multinode_trial_vs_bare_pair": nodes, "digest_cost": 0.03,
            "targets_met": {"digest_cost": targets.met("digest_cost", 0.03),
                            "multirank_trial_vs_single": targets.met("multirank_trial_vs_single", ranks),
                            "multinode_trial_vs_bare_pair": targets.met("multinode_trial_vs_bare_pair", nodes),
                            "multirank_ci_profile_seconds": targets.met("multirank_ci_profile_seconds", ranks_ci),
                            "trial_vs_import": targets.met("trial_vs_import", trial),
                            "script_trial_vs_import": targets.met("script_trial_vs_import", trial),
                            "integrity_states_per_min": targets.met("integrity_states_per_min", states),
                            "power_loss_states_per_min": targets.met("power_loss_states_per_min", power),
                            "ci_profile_seconds": targets.met("ci_profile_seconds", ci)},
            "details": {"digest_per_step_s": 0.0004, "digest_compare_per_curve_s": 0.00002,
                        "multirank_trial_s": 0.4, "multirank_trial_schedule": "fs:3@r1", "multirank_ci": None,
                        "multinode_trial_s": 0.7, "multinode_trial_schedule": "save:6/5@node1",
                        "multinode_trial_vs_bare_pair_spread": [2.0, 2.6], "bare_pair_s": 0.3,
                        "bare_pair_stop_after": 6, "multinode_trial_vs_single": 4.4,
                        "bare_import_torch_s": 2.0, "warm_trial_s": 0.16, "script_trial_s": 0.16, "fresh_trial_s": 8.0,
                        "fresh_vs_warm": 50.0,
                        "crash_states": 121, "crash_states_seconds": 6.0, "state_workers": 2,
                        "power_loss_states": 188, "power_loss_seconds": 7.5,
                        "ci": {"summary": "11 passed", "covers_every_fs_op_of_a_save": True,
                               "crash_states_checked": 121, "recorded_operations": 105},
                        "repeats": 7, "fresh_repeats": 3, "load_avg_before_after": [0.5, 0.9],
                        "machine": {"cpus": 2, "python": "3.11", "torch": "2.13.0"}}}


def test_targets_and_markdown_table():
    assert targets.met("trial_vs_import", 0.1) and not targets.met("trial_vs_import", 0.11)
    assert targets.met("integrity_states_per_min", 1000) and not targets.met("integrity_states_per_min", 999)
    assert targets.met("ci_profile_seconds", None) is None
    md = targets.format_markdown(_result(states=900.0), "python -m conformance.bench")
    assert "| `trial_vs_import` | 0.080 | <= 0.1 | yes |" in md
    assert "| `integrity_states_per_min` | 900 | >= 1000 | no |" in md
    assert "| `power_loss_states_per_min` | 1500 | >= 1000 | yes |" in md
    assert "| `multirank_trial_vs_single` | 2.50 | <= 3.0 | yes |" in md
    assert "| `multirank_ci_profile_seconds` | not run | <= 300 | - |" in md
    assert ("| `multinode_trial_vs_bare_pair` | 2.30 | <= 2.0 | no | 2-node x 2-rank trial (save:6/5@node1) 700 ms / "
            "bare 4-rank torchrun pair (stopped after step 6, resumed) 300 ms") in md
    assert targets.met("multinode_trial_vs_bare_pair", 2.0) and not targets.met("multinode_trial_vs_bare_pair", 2.01)
    assert "every fs op of a save covered: yes (121 states / 105 recorded ops)" in md
    assert "| `digest_cost` | 0.0300 | <= 0.05 | yes | state digest 0.40 ms x 5 (save steps, and after the resume)" in md
    assert targets.met("digest_cost", 0.05) and not targets.met("digest_cost", 0.051)


def test_replace_section_replaces_only_its_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{targets.MARKER}\n\nold table\n\n## next\nkept\n")
    replace_section(readme, targets.MARKER, "new table")
    assert readme.read_text() == f"# x\n\n{targets.MARKER}\n\nnew table\n\n## next\nkept\n"
    with pytest.raises(MarkerMissing, match="no line '<!-- other -->'"):
        replace_section(readme, "<!-- other -->", "x")


def test_the_readme_updater_imports_no_torch():
    code = "import sys, conformance.report.readme; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_bench_help_names_the_json_keys():
    out = subprocess.run([sys.executable, "-m", "conformance.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for key in ("trial_vs_import", "script_trial_vs_import", "integrity_states_per_min", "power_loss_states_per_min",
                "ci_profile_seconds"):
        assert key in out.stdout
    json.dumps(_result())  # the result is plain JSON


# -- the A/B mode: the wiring only (a fake worker, no trainer; what it measures is run by hand) -----
FAKE_WORKER = r"""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import side   # this checkout's own module, found on its own sys.path
say = lambda obj: (sys.stdout.write(json.dumps(obj) + "\n"), sys.stdout.flush())
say({"ready": True, "point": side.NAME, "conformance": os.getcwd()})
for line in sys.stdin:
    with open(os.environ["AB_ORDER"], "a") as f:
        f.write(side.NAME + "\n")
    say({"s": side.SECONDS})
"""


def _checkout(tmp_path, name, seconds):
    root = tmp_path / name
    root.mkdir()
    (root / "side.py").write_text(f"NAME = {name!r}\nSECONDS = {seconds}\n")
    return root


def test_ab_alternates_the_two_checkouts_each_in_its_own_process(tmp_path, monkeypatch):
    order = tmp_path / "order"
    monkeypatch.setenv("AB_ORDER", str(order))
    new, old = _checkout(tmp_path, "new", 0.3), _checkout(tmp_path, "old", 0.2)
    r = bench_ab.ab(old, 4, new_root=new, worker=FAKE_WORKER)
    assert order.read_text().split() == ["new", "old", "old", "new", "new", "old", "old", "new"]
    assert r["new_vs_old"] == pytest.approx(1.5) and r["ratio_of_medians"] == pytest.approx(1.5)
    assert r["new_vs_old_spread"] == pytest.approx([1.5, 1.5])
    d = r["details"]
    assert d["all_times_s"] == {"new": [0.3] * 4, "old": [0.2] * 4} and len(d["pair_ratios"]) == 4
    assert (d["new"]["point"], d["old"]["point"]) == ("new", "old")
    assert (d["new"]["conformance"], d["old"]["conformance"]) == (str(new), str(old))   # each ran in its checkout
    text = bench_ab.format_ab(r)
    assert "new/old: 1.500 (median of 4 alternating pairs" in text and "old s: 0.200 0.200 0.200 0.200" in text
    json.dumps(r)


def test_ab_says_why_a_side_did_not_start(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)exited 3:.*broken checkout"):
        bench_ab.ab(tmp_path, 1, new_root=tmp_path,
                 worker="import sys; sys.stderr.write('broken checkout'); sys.exit(3)")


def test_ab_command_line_and_the_real_worker_compiles():
    args = bench.build_parser().parse_args(["--ab", "/tmp/old", "--rounds", "3", "--json"])
    assert (args.ab, args.rounds, args.json) == ("/tmp/old", 3, True)
    compile(bench_ab.AB_WORKER, "AB_WORKER", "exec")


# -- the warm trial's final run starts while the kill's landing is checked: a miss still raises ------
BASELINE = """\
100  openat(AT_FDCWD</run>, "/ck/.a.tmp", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = 3</ck/.a.tmp>
100  write(3</ck/.a.tmp>, "data", 4) = 4
100  fsync(3</ck/.a.tmp>) = 0
100  rename("/ck/.a.tmp", "/ck/a") = 0
100  write(7</other/loss.jsonl>, "{\\"step\\": 1, \\"loss\\": 0.5}\\n", 27) = 27
"""


class _NeverKills:
    """A runner whose faulted process runs to its end (the kill never comes); records each run."""

    limits = jobs = None

    def __init__(self):
        self.runs: list[tuple[bool, str]] = []

    def run_process(self, adapter, spec, ckpt_dir, loss_log, *, tracing=None, stop=None):
        from conformance.model.process import ProcessResult
        self.runs.append((tracing is not None, "started"))
        result = ProcessResult(0, {1: 0.5}, "", trace_text="")
        self.runs[-1] = (tracing is not None, "finished")
        return result


def test_a_kill_that_does_not_land_still_fails_the_trial_and_leaves_no_final_run_behind(tmp_path):
    from pathlib import Path

    from conformance.faults.delivery import CrashNotLanded
    from conformance.faults.scenario import run_schedule
    from conformance.model.crash import CrashPoint
    from conformance.model.process import ProcessResult, RunSpec
    from conformance.trace import recording, strace

    spec = RunSpec(1, 1, 0)
    base = recording.build(strace.parse(BASELINE), spec, ProcessResult(0, {1: 0.5}, ""), Path("/ck"),
                           Path("/other/loss.jsonl"))
    runner = _NeverKills()
    with pytest.raises(CrashNotLanded, match="was not delivered"):
        run_schedule(runner, None, spec, (CrashPoint("fs", 1),), tmp_path, base)
    assert runner.runs == [(True, "finished"), (False, "finished")]   # the final run was waited for
