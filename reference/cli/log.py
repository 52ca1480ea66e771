"""`python -m resume_conformance.reference log DIR`: the checkpoints of a run directory as a lineage DAG.

One line per checkpoint (id, step, branch, parent, tier, size, why it was saved), oldest first
within each branch; `--format dot` prints Graphviz. `--cold URL` adds the cold tier's committed
checkpoints (tier `cold`, or `hot+cold` for one in both).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .. import lineage
from ..catalog import list_checkpoints, read_meta
from ..cold.demotion import branch_rel
from ..cold.fs import ColdStorageError
from ..cold.store import ColdTier, checkpoint_files
from ..errors import CheckpointError

EXIT_OK, EXIT_USAGE, EXIT_NOTHING = 0, 2, 3


@dataclasses.dataclass
class Node:
    id: str
    step: int
    branch: str
    parent: str | None
    tiers: list[str]
    size: int
    why: str


def _why(meta: dict) -> str:
    trigger = meta.get("trigger") if isinstance(meta.get("trigger"), dict) else {}
    reasons = ", ".join(str(r) for r in trigger.get("reasons") or ())
    return reasons + (" [best]" if trigger.get("best") else "")


def _lineage(meta: dict, where) -> lineage.Lineage | None:
    try:
        return lineage.Lineage.from_json(meta.get("lineage"), where)
    except CheckpointError:
        return None


def collect(run_dir: Path, cold: ColdTier | None = None) -> list[Node]:
    """Every checkpoint of every branch, hot and (with `cold`) cold, joined by id."""
    nodes: dict[str, Node] = {}
    for branch in lineage.branches(run_dir):
        for info in list_checkpoints(branch.directory):
            try:
                meta = read_meta(info)
                size = sum((branch.directory / rel).stat().st_size for rel in checkpoint_files(info.path))
            except (CheckpointError, OSError):
                continue          # not committed, or damaged: `fsck` is the tool for those
            record = _lineage(meta, info.path)
            cid = lineage.checkpoint_id(branch.name, info.step)
            nodes[cid] = Node(cid, info.step, branch.name, record.parent if record else None, ["hot"], size, _why(meta))
        if cold is None:
            continue
        for c in cold.list(branch_rel(branch.name)):
            cid = lineage.checkpoint_id(branch.name, c.step)
            if cid in nodes:
                nodes[cid].tiers.append("cold")
                continue
            record = _lineage(c.meta, c.marker)
            nodes[cid] = Node(cid, c.step, branch.name, record.parent if record else None, ["cold"],
                              sum(f.bytes for f in c.files), _why(c.meta))
    order = {b.name: i for i, b in enumerate(lineage.branches(run_dir))}
    return sorted(nodes.values(), key=lambda n: (order.get(n.branch, 0), n.step))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_text(nodes: list[Node], head: str) -> str:
    header = ("id", "step", "branch", "parent", "tier", "size", "saved because")
    rows = [(n.id + (" (HEAD)" if n is _newest(nodes, head) else ""), str(n.step), n.branch, n.parent or "-",
             "+".join(n.tiers), _size(n.size), n.why or "-") for n in nodes]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [header] + rows)


def _newest(nodes: list[Node], head: str) -> Node | None:
    return max((n for n in nodes if n.branch == head), key=lambda n: n.step, default=None)


def format_dot(nodes: list[Node], head: str) -> str:
    lines = ["digraph checkpoints {", "  rankdir=LR;", '  node [shape=box, fontname="monospace"];']
    ids = {n.id for n in nodes}
    for n in nodes:
        style = ', style=bold' if n is _newest(nodes, head) else ""
        style += ', style=dashed' if n.tiers == ["cold"] else ""
        label = f"{n.id}\\nstep {n.step} | {'+'.join(n.tiers)}\\n{_size(n.size)}" + (f"\\n{n.why}" if n.why else "")
        lines.append(f'  "{n.id}" [label="{label}"{style}];')
    for n in nodes:
        if n.parent is not None:
            missing = "" if n.parent in ids else ", style=dotted"
            lines.append(f'  "{n.parent}" -> "{n.id}"[color=black{missing}];')
    lines.append("}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("log", help="print the checkpoints of a run directory as a lineage DAG",
                       description="One line per checkpoint: id, step, branch, parent, tier, size, and why it was "
                                   "saved. Exit 0, 2 usage error or unreachable cold tier, 3 no checkpoints.")
    p.add_argument("directory", type=Path, metavar="DIR")
    p.add_argument("--format", choices=("text", "dot"), default="text")
    p.add_argument("--cold", metavar="URL", help="also list the checkpoints committed in this cold tier")
    p.set_defaults(run=run)


def run(args) -> int:
    if not args.directory.is_dir():
        print(f"log: {args.directory}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    try:
        cold = ColdTier(args.cold) if args.cold else None
        head = lineage.read_head(args.directory)
        nodes = collect(args.directory, cold)
    except (ColdStorageError, CheckpointError, ValueError) as exc:
        print(f"log: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not nodes:
        print(f"log: no committed checkpoints in {args.directory}", file=sys.stderr)
        return EXIT_NOTHING
    print(format_dot(nodes, head) if args.format == "dot" else format_text(nodes, head))
    return EXIT_OK
