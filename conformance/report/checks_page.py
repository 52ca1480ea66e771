"""The checks as the docs show them: the README's table (each check's short title, what it needs,
a link) and docs/checks.md (each check's full summary, its fix lines and where it is decided),
rendered from the registry and the fixes. `python -m conformance.report.readme` writes both and
tests compare them; the registry itself stays the record of what each check is."""
from __future__ import annotations

from ..checks.fixes import CAUSE_FIXES, FIXES
from ..checks.registry import CHECKS

TABLE_MARKER = "<!-- checks-table -->"
# How the table names a need that is not an adapter capability (any other need is one).
NEEDS = {"trace": "strace", "multirank": "2+ ranks", "resume_python": "`--resume-python`",
         "lost_node_storage": "`cold_tier` (or `node_local_storage`, `--nnodes` >= 2)"}


def markdown_table() -> str:
    """The README's checks table, generated from this registry (a test keeps the README in step): each
    check's id, links to what it asserts in full, and what it needs to run."""
    rows = ["| check id | what it asserts (in full: docs/checks.md) | needs |", "|---|---|---|"]
    for c in CHECKS:
        ids = f"`{c.id}[{'|'.join(c.params)}]`".replace("|", "\\|") if c.params else f"`{c.id}`"
        capabilities = [f"`{n}`" for n in c.needs if n not in NEEDS]
        needs = [NEEDS[n] for n in c.needs if n in NEEDS]
        if capabilities:
            needs.append(f"capabilit{'ies' if len(capabilities) > 1 else 'y'} {', '.join(capabilities)}")
        if c.precondition != "none":
            needs.append("deterministic " + ("losses and file ops" if c.precondition == "operations" else "losses"))
        rows.append(f"| [{ids}](docs/checks.md#{c.id}) | {c.title} | {', '.join(needs) or '-'} |")
    return "\n".join(rows)


def checks_page() -> str:
    """docs/checks.md: every check, what it asserts and what to change when it fails (the `fix:` line
    of its failures links here)."""
    out = ["# The checks, and what to change when one fails", "",
           "Generated from `conformance/checks/registry.py` and `conformance/checks/fixes.py` by",
           "`python -m conformance.report.readme`. A failure's `fix:` line links to its check's section.", ""]
    for c in CHECKS:
        cases = f" Cases: {', '.join(f'`{c.id}[{p}]`' for p in c.params)}." if c.params else ""
        out += [f"## `{c.id}`", "", f"{c.title[0].upper()}{c.title[1:]}.", "",
                f"What it asserts: {c.summary}.{cases}", "", f"Fix: {FIXES[c.id]}.", ""]
        out += [line for f in CAUSE_FIXES if f.check == c.id for line in (f"Fix when {f.cause}: {f.fix}.", "")]
        out += [f"Decided in {' and '.join(f'`{m}`' for m in c.decided_in)}.", ""]
    return "\n".join(out)
