"""Verdicts as exact as the trainer: the learned tolerance (checks/tolerance.py), state digests
(model/digest.py, checks/digests.py, the loss log's `state` and `restored`), and the checks'
stricter halves judged as pure functions (retention's promise, a run that ends on its cadence)."""
from __future__ import annotations

import json

import pytest

from conformance.checks import compound, diagnosis, digests, lifecycle
from conformance.checks.failures import format_mismatches, loss_mismatches
from conformance.checks.tolerance import NOISE_MULTIPLE, capped, learned
from conformance.contract import StateLeftOut, state_digest
from conformance.model import evidence
from conformance.model.process import Curve, RunSpec, read_losses
from conformance.offline.retained import CompoundState


def test_noise_zero_means_bitwise_and_noise_gives_a_multiple_never_above_the_cap():
    assert learned(0.0, 1e-4).value == 0.0 and learned(0.0, 1e-4).exact
    assert learned(1e-7, 1e-4).value == pytest.approx(NOISE_MULTIPLE * 1e-7)
    assert learned(1e-3, 1e-4).value == 1e-4          # the cap, never above it
    assert learned(None, 1e-4).value == 1e-4
    assert "another world size" in capped(1e-4, "another world size").describe()


def test_an_exact_trainer_fails_a_resume_a_fixed_tolerance_would_pass():
    base, resumed = {1: 1.0, 2: 2.0}, {2: 2.0 + 3e-8}
    assert not loss_mismatches(base, resumed, 1e-4)
    rows = loss_mismatches(base, resumed, learned(0.0, 1e-4))
    assert [r[0] for r in rows] == [2]
    assert "exact trainer, inexact resume" in format_mismatches(rows)


def test_a_verdict_comparison_is_recorded_and_an_experiment_is_not():
    evidence.take()
    loss_mismatches({1: 1.0}, {1: 1.0}, 1e-4)            # an experiment: a bare number
    assert evidence.take() == []
    tol = learned(0.0, 1e-4)
    loss_mismatches({1: 1.0, 2: 2.0}, {1: 1.0}, tol)
    loss_mismatches({1: 1.0, 2: 2.0}, {2: 2.0}, tol)
    (found,) = evidence.take()
    assert isinstance(found, evidence.Compared)
    assert (found.curves, found.steps, found.max_abs_diff, found.exact) == (2, 2, 0.0, True)
    assert found.summary().startswith("exact:")


def test_state_digest_is_exact_and_stable():
    torch = pytest.importorskip("torch")
    a = torch.nn.Linear(3, 2).double()
    b = torch.nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    assert state_digest(model=a) == state_digest(model=b)
    with torch.no_grad():
        b.weight[0, 0] = torch.nextafter(b.weight[0, 0], torch.tensor(2.0, dtype=torch.float64))
    assert state_digest(model=a) != state_digest(model=b)          # one ulp
    assert state_digest(x={"a": 1, "b": 2}) == state_digest(x={"b": 2, "a": 1})
    assert state_digest(x=1) != state_digest(x=1.0) != state_digest(x="1")
    assert set(state_digest(rng=True, skipped=None)) == {"rng"}
    # A value with no state to read is named, not refused (issue 53: a ZeRO optimizer's state holds objects).
    with pytest.warns(StateLeftOut, match=r"x \(builtins\.object: it has no state_dict\(\) and no attributes to read\)"):
        assert state_digest(x=object()).left_out[0].path == "x"


def test_the_loss_log_carries_state_and_restored_digests(tmp_path):
    log = tmp_path / "loss.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in (
        {"step": 10, "loss": 1.5, "state": {"model": "m1", "rng": "r1"}, "restored": {"model": "m0", "rng": "rX"}},
        {"step": 11, "loss": 1.25, "state": {"model": "m2", "rng": 7}},
        {"step": 12, "loss": 1.0})) + "\n{\"step\": 13, \"lo")
    curve = read_losses(log)
    assert dict(curve) == {10: 1.5, 11: 1.25, 12: 1.0}
    assert curve.states == {10: {"model": "m1", "rng": "r1"}, 11: {"model": "m2", "rng": "7"}}
    assert curve.restored == (9, {"model": "m0", "rng": "rX"})


def _curve(losses, states, restored=None) -> Curve:
    c = Curve(losses, states=states)
    c.restored = restored
    return c


def test_comparable_components_are_those_equal_in_both_uninterrupted_runs():
    a = _curve({1: 1.0, 2: 2.0}, {1: {"model": "x", "clock": "t1"}, 2: {"model": "y", "clock": "t2"}})
    b = _curve({1: 1.0, 2: 2.0}, {1: {"model": "x", "clock": "t9"}, 2: {"model": "y", "clock": "t8"}})
    assert digests.comparable(a, b) == ("model",)
    assert digests.comparable({1: 1.0}, b) == ()


def test_a_state_difference_with_equal_losses_fails_and_names_the_component():
    base = _curve({9: 0.5, 10: 1.0, 11: 2.0}, {9: {"model": "a", "ema": "e9"}, 10: {"model": "b", "ema": "e"},
                                                11: {"model": "c", "ema": "f"}})
    resumed = _curve({10: 1.0, 11: 2.0}, {10: {"model": "b", "ema": "E"}, 11: {"model": "c", "ema": "F"}})
    rows = loss_mismatches(base, resumed, learned(0.0, 1e-4, ("ema", "model")))
    assert rows and rows.state_only and rows[0][0] == 10
    assert rows.state.describe() == "ema state differs after resume at step 10; model equal"
    assert "state: ema state differs" in format_mismatches(rows)
    assert not loss_mismatches(base, resumed, learned(0.0, 1e-4, ("model",)))   # ema not comparable: left out


def test_the_restored_digests_name_a_draw_made_during_set_up():
    base = _curve({9: 0.5, 10: 1.0}, {9: {"model": "a", "rng": "r9"}, 10: {"model": "b", "rng": "r10"}})
    resumed = _curve({10: 1.1}, {10: {"model": "B", "rng": "R"}}, restored=(9, {"model": "a", "rng": "r9+1"}))
    found = digests.first_state_mismatch(base, resumed, ("model", "rng"))
    assert found.at_setup and found.differs == ("rng",) and found.equal == ("model",)
    cause = diagnosis._from_digests(None, RunSpec(total_steps=14, save_every=3, seed=0), found, 0)
    assert cause.cause.startswith("RNG state: not what the uninterrupted run had at step 9")
    assert "state digests the trainer logged" in cause.evidence[0]


def test_a_run_ends_on_its_cadence_for_restart_after_finish():
    assert lifecycle.ends_on_save(RunSpec(total_steps=14, save_every=3, seed=0)).total_steps == 15
    assert lifecycle.ends_on_save(RunSpec(total_steps=14, save_every=4, seed=0)).total_steps == 16
    assert lifecycle.ends_on_save(RunSpec(total_steps=12, save_every=4, seed=0)) is None


def test_a_restore_point_deleted_before_the_commit_fails_even_with_an_older_fallback():
    state = CompoundState("kill", 68, damaged=9, promised=6, in_progress=12, in_progress_whole=False,
                          files=("step-9/index.json",), promised_intact=True, missing=(3,))
    problem = compound.judge(state, 0, {10: 1.0}, 6, {10: 1.0}, learned(0.0, 1e-4), 10, lambda r, l: False)
    assert problem and "the checkpoint(s) of step 3" in problem and "fewer restore points" in problem
    whole = CompoundState("kill", 68, 9, 6, 12, False, ("step-9/index.json",), True, ())
    assert compound.judge(whole, 0, {10: 1.0}, 6, {10: 1.0}, learned(0.0, 1e-4), 10, lambda r, l: False) is None


def test_a_restore_proven_exact_leaves_the_later_steps_to_the_losses():
    base = _curve({9: 0.5, 10: 1.0}, {9: {"model": "a"}, 10: {"model": "b"}})
    later = _curve({10: 1.0}, {10: {"model": "b'"}}, restored=(9, {"model": "a"}))
    assert digests.first_state_mismatch(base, later, ("model",)) is None
    unproven = _curve({10: 1.0}, {10: {"model": "b'"}})
    assert digests.first_state_mismatch(base, unproven, ("model",)).differs == ("model",)
