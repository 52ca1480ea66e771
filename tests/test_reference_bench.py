"""reference.bench: a ratio is judged on the spread of its per-round values, never on one noisy
sample."""
from __future__ import annotations

import pytest
from resume_conformance.reference.bench.judge import judge, per_round
from resume_conformance.reference.bench.output import format_markdown, format_table
from resume_conformance.reference.bench.run import run_benchmark


def test_a_ratio_is_met_only_when_its_whole_spread_meets_the_target():
    steady = [1.05, 1.06, 1.04, 1.07, 1.05, 1.06, 1.05]
    assert judge(steady, ">=", 1.0, shortest_median_s=0.8).verdict == "met"
    assert judge(steady, ">=", 1.1, shortest_median_s=0.8).verdict == "missed"
    noisy = [1.26, 0.49, 1.1, 0.6, 1.3, 0.5, 1.2]     # the two runs issue 13 quotes, as rounds
    j = judge(noisy, ">=", 0.9, shortest_median_s=0.8)
    assert j.verdict == "inconclusive" and "crosses the target 0.9" in j.why
    assert j.spread[0] < 0.9 < j.spread[1] and j.range == (0.49, 1.3)
    assert judge([0.05, 0.06, 0.05, 0.04, 0.05, 0.05, 0.06], "<=", 0.10, shortest_median_s=1.0).verdict == "met"


def test_too_few_rounds_or_too_short_samples_are_inconclusive():
    assert "at least 7 are needed" in judge([1.5, 1.5, 1.5], ">=", 1.0, shortest_median_s=1.0).why
    short = judge([1.5] * 7, ">=", 1.0, shortest_median_s=0.05)
    assert short.verdict == "inconclusive" and "larger --size-mb" in short.why


def test_per_round_ratios_pair_the_variants_of_each_round():
    assert per_round([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]


def test_a_short_run_reports_every_ratio_with_its_spread_and_says_it_cannot_judge(tmp_path):
    result = run_benchmark(2, 2, tmp_path, memory=False)
    timed = {"sharded_save_vs_raw", "atomic_save_vs_torch_save", "verified_load_vs_raw_read",
             "chain_restore_vs_full", "compressed_save_vs_plain", "async_stall_vs_copy", "demotion_stall_vs_copy"}
    counted = {"incremental_bytes_frac_frozen", "incremental_bytes_frac_sparse", "compress_ratio_bf16",
               "compress_ratio_fp32", "shuffle_gain"}
    assert set(result["ratios"]) == timed | counted
    for name, t in result["targets"].items():
        if name in timed:
            assert t["verdict"] == "inconclusive" and not t["met"], (name, t)
        else:      # exact counts: one value, judged as it is
            assert t["verdict"] in ("met", "missed") and t["spread"][0] == t["spread"][1], (name, t)
        assert t["spread"][0] <= result["ratios"][name] <= t["spread"][1] or t["spread"][0] == t["spread"][1]
    assert result["chains"]["incremental_bytes_frac_frozen"]["sgd"]["frac"] < result["ratios"]["incremental_bytes_frac_frozen"]
    result.update(command="python -m resume_conformance.reference.bench --size-mb 2 --repeats 2", priority="unchanged")
    assert "inconclusive: 2 rounds" in format_table(result)
    markdown = format_markdown(result, result["command"])
    assert "| inconclusive |" in markdown and "Chained checkpoints: frozen backbone" in markdown


def test_without_zstandard_the_compression_rows_say_so_and_the_rest_are_measured(tmp_path, monkeypatch):
    from resume_conformance.reference.bench import chains
    monkeypatch.setattr(chains.codec, "zstandard_available", lambda: False)
    result = run_benchmark(2, 2, tmp_path, memory=False)
    assert {name: result["ratios"][name] for name in chains.COMPRESSION_ROWS} == dict.fromkeys(
        chains.COMPRESSION_ROWS, "needs zstandard")
    assert not set(chains.COMPRESSION_ROWS) & set(result["targets"])
    assert isinstance(result["ratios"]["chain_restore_vs_full"], float) and "chain_restore_vs_full" in result["targets"]
    result.update(command="python -m resume_conformance.reference.bench --size-mb 2 --repeats 2", priority="unchanged")
    assert "compress_ratio_bf16          needs zstandard" in format_table(result)
    markdown = format_markdown(result, result["command"])
    assert "| `shuffle_gain` | - | - | - | needs zstandard |" in markdown
    assert "Compression: not measured (needs zstandard" in markdown


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--size-mb", "0"]])
def test_bad_options_are_usage_errors(argv, capsys):
    from resume_conformance.reference.bench.cli import main
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
