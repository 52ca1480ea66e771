"""The checks: one module per family, each deciding its checks, and one registry listing them.

| module | decides |
|---|---|
| determinism.py | determinism_precondition |
| schedules.py | resume_matches_baseline, no_lost_work, no_torn_state |
| states.py | crash_states |
| damage.py | corruption_detected |
| untrusted.py | untrusted_checkpoint |
| legacy.py | schema_migration |
"""
from .registry import BY_ID, CHECKS, Check, all_check_ids, skip_reason, split_id  # noqa: F401
from .session import Session  # noqa: F401
