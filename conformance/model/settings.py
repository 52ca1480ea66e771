"""The suite's fixed numbers and its Hypothesis profiles, in one place.

Profiles, chosen with Hypothesis's own `--hypothesis-profile`:
- `quick`: a few derandomized examples per check, for development;
- `ci`: the gate. Draws come from a fixed seed (SEEDED_PROFILES, applied by the suite), so the same
  code gets the same verdict, while failures kept in the example database (e.g. found by a
  nightly fuzz run) replay first; derandomize=True would switch the database off;
- `fuzz`: thousands of random schedules; failures are kept in the database.
"""
from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# Long enough for a checkpoint at a two-digit step with steps after it (ckpt-9 vs ckpt-12).
VERSION = "0.1.0"   # the suite's version (pyproject.toml has the same); reports record it
TOTAL_STEPS = 14
SEED = 0
CADENCES = (3, 4)   # with the bundled trainer's 5 batches per epoch, both save mid-epoch
DEFAULT_TOL = 1e-4
DEFAULT_GRACE_S = 5.0   # SIGTERM to SIGKILL (SLURM's KillWait and Kubernetes default to 30 s)
# hang: how long a job may run after one rank is stopped; the trainer is told a third of it
# (CONFORMANCE_HANG_TIMEOUT) for its collectives, leaving the rest for its ranks to exit.
DEFAULT_HANG_TIMEOUT_S = 30.0

SLOW_OK = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture])
EXAMPLE_DB = DirectoryBasedExampleDatabase(".hypothesis/examples")
settings.register_profile("quick", max_examples=3, derandomize=True, phases=[Phase.explicit, Phase.generate],
                          **SLOW_OK)
settings.register_profile("ci", max_examples=8, derandomize=False, database=EXAMPLE_DB, **SLOW_OK)
settings.register_profile("fuzz", max_examples=5000, derandomize=False, database=EXAMPLE_DB, **SLOW_OK)
# quick and ci draw from a fixed seed (applied by the suite), not from a hash of the test's source:
# the same trainer gets the same schedules when the suite's code is edited.
SEEDED_PROFILES = {"quick": 0, "ci": 0}
# What each profile is for, in the words a usage error lists them with.
PROFILE_USES = {
    "quick": "a few examples per check, for development",
    "ci": f"the gate: {settings.get_profile('ci').max_examples} examples per check, seeded",
    "fuzz": "thousands of random schedules, for nightly runs",
}
PROFILES = tuple(PROFILE_USES)
