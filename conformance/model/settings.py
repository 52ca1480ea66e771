"""The suite's fixed numbers and its Hypothesis profiles, in one place.

Profiles, chosen with Hypothesis's own `--hypothesis-profile` (the suite's tests run under
`conformance-ci` when another profile, or none, is selected):
- `conformance-quick`: a few derandomized examples per check, for development;
- `conformance-ci`: the gate. Draws come from a fixed seed (SEEDED_PROFILES, applied by the suite), so the same
  code gets the same verdict, while failures kept in the example database (e.g. found by a
  nightly fuzz run) replay first; derandomize=True would switch the database off;
- `conformance-fuzz`: thousands of random schedules; failures are kept in the database.

The database of `conformance-ci` and `conformance-fuzz` is `.hypothesis/examples` unless CONFORMANCE_EXAMPLE_DB names another
(`example_database`), so that a failure one machine finds replays first on the others.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)


def package_version() -> str:
    """The installed distribution's version: pyproject.toml is its one source (a checkout run
    without installing it has none to report)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("resume-conformance")
    except PackageNotFoundError:
        return "0+unknown"


# Long enough for a checkpoint at a two-digit step with steps after it (ckpt-9 vs ckpt-12).
VERSION = package_version()   # the suite's version, from pyproject.toml via the installed metadata; reports record it
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
LOCAL_EXAMPLES = ".hypothesis/examples"
EXAMPLE_DB_VARIABLE = "CONFORMANCE_EXAMPLE_DB"
NIGHTLY_ARTIFACT = "hypothesis-example-db"   # Hypothesis's own default name for the uploaded database
_GITHUB = re.compile(r"(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)/(?P<repo>[A-Za-z0-9._-]+)"
                     r"(?::(?P<artifact>[^\s:/\\\"<>|*?]+))?")


class ExampleDbError(ValueError):
    """CONFORMANCE_EXAMPLE_DB names no database; the message says why and what to write instead."""


def example_database(value: str | None) -> ExampleDatabase:
    """The example database of the `ci` and `fuzz` profiles, from CONFORMANCE_EXAMPLE_DB:
    unset or empty: `.hypothesis/examples`; `dir:PATH`: a directory every machine mounts (read and
    written by all); `github:OWNER/REPO[:ARTIFACT]`: the newest artifact of that name (default
    hypothesis-example-db, e.g. uploaded by the nightly), read-only, beside `.hypothesis/examples`,
    which gets what this machine finds. Nothing is read, written or downloaded here: Hypothesis
    fetches the artifact (GITHUB_TOKEN from the environment) at the first lookup of a run."""
    text = (value or "").strip()
    if not text:
        return DirectoryBasedExampleDatabase(LOCAL_EXAMPLES)
    kind, _, rest = text.partition(":")
    fix = (f"  fix: {EXAMPLE_DB_VARIABLE}=dir:/mnt/shared/hypothesis (a directory on a volume every machine mounts) "
           f"or {EXAMPLE_DB_VARIABLE}=github:OWNER/REPO[:ARTIFACT], or unset it for {LOCAL_EXAMPLES}")
    if kind == "dir":
        path = Path(rest).expanduser()
        if not rest.strip():
            raise ExampleDbError(f"{EXAMPLE_DB_VARIABLE}={value!r} names no directory after 'dir:'\n{fix}")
        if path.exists() and not path.is_dir():
            raise ExampleDbError(f"{EXAMPLE_DB_VARIABLE}={value!r}: {path} exists and is not a directory\n{fix}")
        return DirectoryBasedExampleDatabase(path)
    if kind == "github":
        m = _GITHUB.fullmatch(rest)
        if m is None:
            raise ExampleDbError(f"{EXAMPLE_DB_VARIABLE}={value!r}: expected github:OWNER/REPO or "
                                 f"github:OWNER/REPO:ARTIFACT after 'github:', got {rest!r}\n{fix}")
        artifact = m.group("artifact") or NIGHTLY_ARTIFACT
        # An explicit path: constructing it then touches no disk, as Hypothesis asks of a plugin's import.
        shared = GitHubArtifactDatabase(m.group("owner"), m.group("repo"), artifact_name=artifact,
                                        path=Path(".hypothesis") / "github-artifacts" / artifact)
        return MultiplexedDatabase(DirectoryBasedExampleDatabase(LOCAL_EXAMPLES), ReadOnlyDatabase(shared))
    raise ExampleDbError(f"{EXAMPLE_DB_VARIABLE}={value!r}: expected dir:PATH or github:OWNER/REPO[:ARTIFACT]\n{fix}")


try:
    EXAMPLE_DB = example_database(os.environ.get(EXAMPLE_DB_VARIABLE))
    EXAMPLE_DB_PROBLEM: str | None = None
except ExampleDbError as exc:   # the plugin stops the run with it as a usage error, before any test runs
    EXAMPLE_DB, EXAMPLE_DB_PROBLEM = DirectoryBasedExampleDatabase(LOCAL_EXAMPLES), str(exc)
# The suite's profiles live in its own namespace: `ci` is the name Hypothesis's documentation uses
# for a team's own profile, and a registry entry of that name would overwrite theirs (or be overwritten).
PREFIX = "conformance-"
GATE_PROFILE = PREFIX + "ci"
settings.register_profile(PREFIX + "quick", max_examples=3, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], **SLOW_OK)
settings.register_profile(GATE_PROFILE, max_examples=8, derandomize=False, database=EXAMPLE_DB, **SLOW_OK)
settings.register_profile(PREFIX + "fuzz", max_examples=5000, derandomize=False, database=EXAMPLE_DB, **SLOW_OK)
# quick and ci draw from a fixed seed (applied by the suite), not from a hash of the test's source:
# the same trainer gets the same schedules when the suite's code is edited.
SEEDED_PROFILES = {PREFIX + "quick": 0, GATE_PROFILE: 0}
# What each profile is for, in the words a usage error lists them with.
PROFILE_USES = {
    PREFIX + "quick": "a few examples per check, for development",
    GATE_PROFILE: f"the gate: {settings.get_profile(GATE_PROFILE).max_examples} examples per check, seeded",
    PREFIX + "fuzz": "thousands of random schedules, for nightly runs",
}
PROFILES = tuple(PROFILE_USES)
# The names before 0.2: `--hypothesis-profile=conformance-ci` still selects the suite's gate for the suite's own
# tests (a team's profile of that name, if any, stays theirs for their tests).
OLD_PROFILE_NAMES = {name.removeprefix(PREFIX): name for name in PROFILES}


def suite_profile(selected: str) -> str:
    """The profile the suite's own tests run under: the selected one where it is the suite's (or
    an old name of one), else the gate's. Hypothesis's `default` (100 unseeded examples) is never
    the gate's verdict: the same code would get different verdicts."""
    if selected.startswith(PREFIX):
        return selected
    return OLD_PROFILE_NAMES.get(selected, GATE_PROFILE)


# A warm failure whose first fresh replay passed is replayed this many more times in each runner
# (that one case only). A race that fails a run of its case with probability p escapes all of them
# with probability (1 - p) ** (2 * n): with 3, 12% at p = 0.3 and 1.6% at p = 0.5, for six more runs
# of one case (a few trainer processes each), paid only on a failure the first replay did not repeat.
REPLAYS_PER_RUNNER = 3
