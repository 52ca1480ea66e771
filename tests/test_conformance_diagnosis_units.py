"""The diagnosis's pure parts (which pattern of matching resume points names the data position), and the
`fix:` line every check failure ends with."""
from __future__ import annotations

import pytest

from conformance.checks.diagnosis import _period


@pytest.mark.parametrize("matching, total, period", [
    ([5, 10], 14, 5),          # every epoch boundary of a 5-step epoch
    ([8], 14, 8),              # an 8-step epoch has one boundary inside a 14-step run
    ([4], 14, None),           # 8 was tried too and did not match: no period
    ([5, 10, 11], 14, None),
    ([1], 14, None),           # every step is a multiple of 1
    ([], 14, None),
])
def test_resumes_matching_only_at_epoch_boundaries_are_a_period(matching, total, period):
    assert _period(matching, total) == period


def test_every_check_failure_ends_with_what_to_change_and_where_the_docs_say_more():
    import dataclasses

    from conformance.checks.failures import ConformanceFailure
    from conformance.checks.registry import BY_ID

    def failing(session, check_id, spec, param, case):
        raise ConformanceFailure(f"[{check_id}] the trainer resumed from scratch\n  replay:   python -m conformance ...")
    check = dataclasses.replace(BY_ID["no_lost_work"], run=failing)
    with pytest.raises(ConformanceFailure) as info:
        check.decide(None, None, "inside_save")
    last = str(info.value).splitlines()[-1]
    assert last.startswith("  fix:      on start, resume from the newest checkpoint that is complete")
    assert last.endswith("(docs/checks.md#no_lost_work)")
