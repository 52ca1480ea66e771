"""Joining the reports of a campaign's shards into one report: `python -m conformance report --merge`.

A fuzz campaign spread over N machines (`soak --random --seed S --shard i/N`) leaves a report per
run on each machine. The campaign has one verdict, so its reports are joined into the files one run
writes (`report.json`, `summary.md`) and a badge: the cases of every report (so the counts are the
sum of theirs), each failure once per check and schedule (`Case.failure`), and the levels from each
check's worst outcome. Only reports of one campaign join: the same trainer, suite version, report
schema and Hypothesis profile; anything else is refused naming the file (MergeError), since a merged
verdict over two trainers or two suites would state something no run tested.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Sequence
from pathlib import Path

from .levels import badge_svg, highest
from .report import REPORT_SCHEMA, AdapterInfo, Report, Source, load_report, write_report

REPORT_FILE = "report.json"
BADGE_FILE = "conformance-badge.svg"
FIX_INPUT = ("give each shard's report directory (what --conformance-report or `soak --out` wrote) or its "
             "report.json")


class MergeError(ValueError):
    """A report that cannot be joined; the message names the file, the problem and a fix."""

    def __init__(self, path: Path, problem: str, fix: str):
        super().__init__(f"{path}: {problem}\n  fix: {fix}")
        self.path, self.problem, self.fix = Path(path), problem, fix


class UnreadableReport(MergeError):
    """Missing, not JSON, not a conformance report, or a report schema this suite does not read."""


class IncompatibleReport(MergeError):
    """A report of another trainer, suite version or Hypothesis profile than the first one given."""


@dataclasses.dataclass(frozen=True)
class Written:
    """The files a merge wrote."""
    report: Path
    summary: Path
    badge: Path


def report_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The report files the inputs name, in order: a file is itself; a directory is its report.json, or,
    for a `soak --out` directory (one directory per run), each run's report.json."""
    files: list[Path] = []
    for given in map(Path, inputs):
        if given.is_dir():
            files += _directory_reports(given)
        elif given.exists():
            files.append(given)
        else:
            raise UnreadableReport(given, "no such file or directory", FIX_INPUT)
    seen: dict[Path, Path] = {}
    for path in files:
        first = seen.setdefault(path.resolve(), path)
        if first is not path:
            also = f" (also as {first})" if str(first) != str(path) else ""
            raise MergeError(path, f"is given twice{also}, so its cases would count twice", "name each shard's report once")
    return files


def _directory_reports(directory: Path) -> list[Path]:
    if (directory / REPORT_FILE).is_file():
        return [directory / REPORT_FILE]
    runs = sorted(p for p in directory.iterdir() if p.is_dir())
    missing = [run for run in runs if not (run / REPORT_FILE).is_file()]
    if len(missing) == len(runs):
        raise UnreadableReport(directory, f"holds no {REPORT_FILE}, and no run directories with one", FIX_INPUT)
    if missing:
        raise UnreadableReport(missing[0], f"this run of a soak directory has no {REPORT_FILE}: the run wrote no "
                               "report (soak's output says why), so the campaign is incomplete",
                               "rerun the shard, or merge its other runs' report.json files by name")
    return [run / REPORT_FILE for run in runs]


def load(path: Path) -> Report:
    """One report, or UnreadableReport naming the file and what is wrong with it."""
    try:
        return load_report(path)
    except ValueError as exc:
        problem = str(exc).removeprefix(f"{path}: ")
        fix = (f"merge reports of schema {REPORT_SCHEMA!r} (written by this suite version); rerun the shard with it"
               if "schema" in problem else FIX_INPUT)
        raise UnreadableReport(path, problem, fix) from None


def _trainer(adapter: AdapterInfo) -> str:
    return f"trainer `{adapter.name}` (`{adapter.spec}`, version {adapter.version or '-'}, capabilities " \
           f"{', '.join(adapter.capabilities) or 'none'})"


def _check_compatible(path: Path, report: Report, first_path: Path, first: Report,
                      tested: tuple[Path, AdapterInfo] | None) -> None:
    """IncompatibleReport unless `report` belongs to the campaign of `first`; `tested`: the first report
    naming a trainer, and that trainer (a report that names none, having no cases, joins any)."""
    if report.adapter is not None and tested is not None and report.adapter != tested[1]:
        raise IncompatibleReport(path, f"tests {_trainer(report.adapter)}, but {tested[0]} tests {_trainer(tested[1])}",
                                 "merge the reports of one trainer; a campaign over several trainers has a report for each")
    suite, other = report.versions.get("suite"), first.versions.get("suite")
    if suite != other:
        raise IncompatibleReport(path, f"was written by suite version {suite}, but {first_path} by {other}",
                                 "run every shard of a campaign with one suite version")
    if report.hypothesis_profile != first.hypothesis_profile:
        raise IncompatibleReport(path, f"ran the Hypothesis profile {report.hypothesis_profile!r}, but {first_path} "
                                 f"ran {first.hypothesis_profile!r}", "run every shard of a campaign with one --profile")


def _joined(values: Sequence[str | None]) -> str | None:
    """One value where all agree, else each distinct one (torch on two machines: "2.13.0, 2.12.0")."""
    distinct = list(dict.fromkeys(v for v in values if v))
    return ", ".join(distinct) if distinct else (values[0] if values else None)


def merge(reports: Sequence[tuple[Path, Report]]) -> Report:
    """One report from the shards' (path, report) pairs; IncompatibleReport if they are not one campaign."""
    if not reports:
        raise ValueError("merge needs at least one report")
    first_path, first = reports[0]
    tested = next(((path, r.adapter) for path, r in reports if r.adapter is not None), None)
    for path, report in reports:
        _check_compatible(path, report, first_path, first, tested)
    adapter = tested[1] if tested else None
    keys = list(dict.fromkeys(k for _, r in reports for k in r.versions))
    versions = {k: _joined([r.versions.get(k) for _, r in reports]) for k in keys}
    sources = [s for path, r in reports
               for s in (r.sources or [Source(str(path), r.created, r.counts, r.header)])]
    cases = sorted((c for _, r in reports for c in r.cases), key=lambda c: c.check)
    return Report(versions, adapter, first.hypothesis_profile, _joined([r.platform for _, r in reports]) or "",
                  _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), cases,
                  header=" | ".join(dict.fromkeys(r.header for _, r in reports if r.header)), sources=sources)


def merge_files(inputs: Sequence[str | Path]) -> Report:
    """The merged report of the files and directories given (MergeError naming the first bad one)."""
    files = report_files(inputs)
    return merge([(path, load(path)) for path in files])


def write(report: Report, directory: Path) -> Written:
    """report.json and summary.md, as a run writes them, and the badge beside them."""
    json_path, md_path = write_report(report, Path(directory))
    badge = Path(directory) / BADGE_FILE
    badge.write_text(badge_svg(report.levels()))
    return Written(json_path, md_path, badge)


def describe(report: Report, written: Written) -> str:
    """What the command prints: each merged report's counts, the sum, the failures and the level."""
    def counts(c: dict[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "no checks ran"
    levels = report.levels()
    top = highest(levels)
    lines = [f"  {s.path}: {counts(s.counts)}" for s in report.sources]
    lines += [f"merged {len(report.sources)} report(s): {counts(report.counts)}; {len(report.failed)} distinct "
              f"failure(s)",
              f"{written.report}, {written.summary} and {written.badge}: "
              f"{top.level + ' ' + top.meaning if top else 'no level met'} "
              f"({', '.join(f'{s.level} {s.status}' for s in levels)})"]
    return "\n".join(lines)
