"""The checks: one module per family, each deciding its checks, and one registry listing them.

| module | decides |
|---|---|
| determinism.py | determinism_precondition |
| schedules.py | resume_matches_baseline, no_lost_work, no_torn_state |
| states.py | crash_states |
| power.py | power_loss |
| storage.py | io_error |
| preemption.py | preemption |
| interrupt.py | interrupt |
| lifecycle.py | restart_after_finish, extend_run |
| compound.py | compound_faults |
| upgrade.py | upgrade_resume |
| hang.py | hang |
| elastic.py | elastic_restart |
| ranks.py | rank_resume, all_or_nothing, reshard |
| damage.py | corruption_detected |
| untrusted.py | untrusted_checkpoint |
| tiers.py | node_loss, branch_resume, demotion_safe |
| nodes.py | node_loss |
| legacy.py | schema_migration |

node_loss has two cases: a cold tier (tiers.py) and node-local storage in a job of several nodes
(nodes.py). Shared by them: session.py (one trainer's baselines and cached runs), noise.py (how noisy
its uninterrupted runs are: whether two agree, by how much, and the tolerance that earns), scratch.py
(where its runs keep their checkpoint directories: CONFORMANCE_SCRATCH), common.py (loss
comparisons and plots), tolerance.py (how exact a comparison is, learned from the trainer's noise),
digests.py (state digests compared component by component), diagnosis.py (the likely cause of a
resume that differs), registry.py
(every check's id, capabilities, level, how its cases are drawn and the functions that decide it;
Check.decided_in names their modules, and a test keeps the table above to it).
"""
from .registry import BY_ID, CHECKS, Check, all_check_ids, skip_reason, split_id  # noqa: F401
from .session import Session  # noqa: F401
