"""The speed benchmark's report (the measurements themselves are run by hand: timed tests on
shared machines would be noise)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conformance import bench
from conformance.readme import MarkerMissing, replace_section


def _result(trial=0.08, states=1200.0, ci=60.0, power=1500.0, ranks=2.5, ranks_ci=None):
    return {"trial_vs_import": trial, "integrity_states_per_min": states, "ci_profile_seconds": ci,
            "power_loss_states_per_min": power, "script_trial_vs_import": trial,
            "multirank_trial_vs_single": ranks, "multirank_ci_profile_seconds": ranks_ci,
            "targets_met": {"multirank_trial_vs_single": bench._met("multirank_trial_vs_single", ranks),
                            "multirank_ci_profile_seconds": bench._met("multirank_ci_profile_seconds", ranks_ci),
                            "trial_vs_import": bench._met("trial_vs_import", trial),
                            "script_trial_vs_import": bench._met("script_trial_vs_import", trial),
                            "integrity_states_per_min": bench._met("integrity_states_per_min", states),
                            "power_loss_states_per_min": bench._met("power_loss_states_per_min", power),
                            "ci_profile_seconds": bench._met("ci_profile_seconds", ci)},
            "details": {"multirank_trial_s": 0.4, "multirank_trial_schedule": "fs:3@r1", "multirank_ci": None,
                        "bare_import_torch_s": 2.0, "warm_trial_s": 0.16, "script_trial_s": 0.16, "fresh_trial_s": 8.0,
                        "fresh_vs_warm": 50.0,
                        "crash_states": 121, "crash_states_seconds": 6.0, "state_workers": 2,
                        "power_loss_states": 188, "power_loss_seconds": 7.5,
                        "ci": {"summary": "11 passed", "covers_every_fs_op_of_a_save": True,
                               "crash_states_checked": 121, "recorded_operations": 105},
                        "repeats": 7, "fresh_repeats": 3, "load_avg_before_after": [0.5, 0.9],
                        "machine": {"cpus": 2, "python": "3.11", "torch": "2.13.0"}}}


def test_targets_and_markdown_table():
    assert bench._met("trial_vs_import", 0.1) and not bench._met("trial_vs_import", 0.11)
    assert bench._met("integrity_states_per_min", 1000) and not bench._met("integrity_states_per_min", 999)
    assert bench._met("ci_profile_seconds", None) is None
    md = bench.format_markdown(_result(states=900.0), "python -m conformance.bench")
    assert "| `trial_vs_import` | 0.080 | <= 0.1 | yes |" in md
    assert "| `integrity_states_per_min` | 900 | >= 1000 | no |" in md
    assert "| `power_loss_states_per_min` | 1500 | >= 1000 | yes |" in md
    assert "| `multirank_trial_vs_single` | 2.50 | <= 3.0 | yes |" in md
    assert "| `multirank_ci_profile_seconds` | not run | <= 300 | - |" in md
    assert "every fs op of a save covered: yes (121 states / 105 recorded ops)" in md


def test_replace_section_replaces_only_its_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{bench._MARKER}\n\nold table\n\n## next\nkept\n")
    replace_section(readme, bench._MARKER, "new table")
    assert readme.read_text() == f"# x\n\n{bench._MARKER}\n\nnew table\n\n## next\nkept\n"
    with pytest.raises(MarkerMissing, match="no line '<!-- other -->'"):
        replace_section(readme, "<!-- other -->", "x")


def test_the_readme_updater_imports_no_torch():
    code = "import sys, conformance.readme; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_bench_help_names_the_json_keys():
    out = subprocess.run([sys.executable, "-m", "conformance.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for key in ("trial_vs_import", "script_trial_vs_import", "integrity_states_per_min", "power_loss_states_per_min",
                "ci_profile_seconds"):
        assert key in out.stdout
    json.dumps(_result())  # the result is plain JSON
