"""The manager's side of the cold tier: one pass that uploads, retains and demotes, and finding
a checkpoint in either tier along a branch's line.

A pass (run in the background after each committed save, and once after a start):
1. lists the committed hot checkpoints and the committed cold ones (markers);
2. decides what is kept over both tiers (retention.keep_set);
3. uploads every kept hot checkpoint without a marker, oldest first (tiers.ColdTier.upload
   verifies the copy, then writes the marker);
4. deletes, under the store lock (never while a save writes pieces): hot checkpoints not kept;
   hot checkpoints kept but beyond the newest `keep_hot` (and not needed by those) whose marker
   exists; cold checkpoints not kept (marker first).
So a hot copy is deleted only after its upload was verified and committed, and a kill at any
operation leaves every kept checkpoint in at least one tier.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import warnings
from pathlib import Path

from .. import lineage
from ..catalog import CheckpointInfo, CheckpointSkippedWarning, list_checkpoints, remove_checkpoints, verify
from ..chain import read as chain
from ..errors import CheckpointError
from ..primitives.atomic import atomic_write_bytes
from ..primitives.integrity import sha256_file as hash_file
from ..retention import candidate, committed, keep_set
from .store import ColdCheckpoint, ColdTier, checkpoint_files


@dataclasses.dataclass(frozen=True)
class Policy:
    keep_last: int | None
    keep_best: int | None
    best_mode: str
    keep_hot: int


@dataclasses.dataclass
class PassResult:
    uploaded: list[str] = dataclasses.field(default_factory=list)
    demoted: list[str] = dataclasses.field(default_factory=list)
    deleted_hot: list[str] = dataclasses.field(default_factory=list)
    deleted_cold: list[str] = dataclasses.field(default_factory=list)


def branch_rel(branch: str) -> str:
    return "" if branch == lineage.MAIN else f"{lineage.BRANCHES}/{branch}"


def _same_checkpoint(directory: Path, info: CheckpointInfo, cold: ColdCheckpoint) -> bool:
    """Whether the cold checkpoint holds this hot one: its commit file (index, manifest, or the
    single file) has the bytes the marker lists."""
    commit = next((f for f in cold.files if f.path == checkpoint_files(info.path)[-1]), None)
    if commit is None:
        return False
    path = directory / commit.path
    return path.stat().st_size == commit.bytes and hash_file(path)[1] == commit.sha256


def run_pass(tier: ColdTier, run_dir: Path, branch: str, policy: Policy,
             store_lock: threading.Lock | contextlib.nullcontext) -> PassResult:
    directory = lineage.branch_dir(run_dir, branch)
    rel = branch_rel(branch)
    result = PassResult()
    sync_run_records(tier, run_dir, branch)
    held, _ = committed(list_checkpoints(directory))
    hot = {name: h.info for name, h in held.items()}
    metas = {name: h.meta for name, h in held.items()}
    needs = {name: h.needs for name, h in held.items()}
    cold = {c.name: c for c in tier.list(rel)}
    candidates = [h.candidate for h in held.values()]
    candidates += [candidate(c.name, c.step, c.meta, c.needs) for c in cold.values() if c.name not in hot]
    newest_hot = max(hot.values(), key=lambda i: i.step, default=None)
    protect = lineage.branch_points(run_dir, branch)
    keep = keep_set(candidates, keep_last=policy.keep_last, keep_best=policy.keep_best, best_mode=policy.best_mode,
                    anchor=newest_hot.path.name if newest_hot else None, protect_steps=protect)
    verified = {f.path: f for c in cold.values() for f in c.files}
    for name, info in sorted(hot.items(), key=lambda kv: kv[1].step):
        if name in cold and not _same_checkpoint(directory, info, cold[name]):
            # Saved again under a name a cold checkpoint of an abandoned attempt has (a start that
            # fell back past it): that one is stale; its marker goes before the new upload.
            tier.delete(cold.pop(name), rel, shared={f.path for c in cold.values() for f in c.files})
            verified = {f.path: f for c in cold.values() for f in c.files}
        if name in cold or name not in keep:
            continue
        try:
            verify(info)
        except CheckpointError as exc:
            warnings.warn(f"not uploading {info.path}: {exc}", CheckpointSkippedWarning, stacklevel=2)
            continue
        uploaded = tier.upload(directory, rel, info.path, needs=list(needs[name]), meta=metas[name], verified=verified)
        cold[name] = uploaded
        verified.update((f.path, f) for f in uploaded.files)
        result.uploaded.append(name)
    hot_kept = sorted((i for n, i in hot.items() if n in keep), key=lambda i: i.step)
    stay_hot: set[str] = set()
    for info in hot_kept[-policy.keep_hot:] if policy.keep_hot else []:
        stay_hot.update(needs[info.path.name])
    with store_lock:
        going = []
        for name, info in sorted(hot.items(), key=lambda kv: kv[1].step):
            if name not in keep:
                result.deleted_hot.append(name)
                going.append(info.path)
            elif name not in stay_hot and name in cold:
                result.demoted.append(name)
                going.append(info.path)
        remove_checkpoints(directory, going, [i.layout for i in hot.values()])
        doomed = [c for n, c in cold.items() if n not in keep]
        shared = {f.path for n, c in cold.items() if n in keep for f in c.files}
        for c in sorted(doomed, key=lambda c: c.step):
            tier.delete(c, rel, shared=shared)
            result.deleted_cold.append(c.name)
    return result


# -- run records: HEAD and branch records travel with the checkpoints ---------------------------
def sync_run_records(tier: ColdTier, run_dir: Path, branch: str) -> None:
    """Copy the record of every branch on the current line, then HEAD.json, to the cold tier
    (where they differ), so a node loss resumes on the right branch: a HEAD there never names a
    branch whose record is not."""
    records = [f"{branch_rel(b.name)}/{lineage.BRANCH_RECORD}" for b, _ in reversed(lineage.line_of(run_dir, branch))
               if b.name != lineage.MAIN]
    if (run_dir / lineage.HEAD_NAME).exists():
        records.append(lineage.HEAD_NAME)
    for rel in records:
        data = (run_dir / rel).read_bytes()
        key = tier.key("", rel)
        try:
            if tier.fs.cat_file(key) == data:
                continue
        except FileNotFoundError:
            pass
        tier.put_bytes(key, data, tier.where("", rel))


def restore_run_records(tier: ColdTier, run_dir: Path) -> None:
    """After a node loss (no HEAD.json here, one in the cold tier): bring back the branch
    records HEAD depends on, then HEAD. Anything unreadable there leaves the run on main."""
    if (run_dir / lineage.HEAD_NAME).exists():
        return
    try:
        head_bytes = tier.fs.cat_file(tier.key("", lineage.HEAD_NAME))
        branch = json.loads(head_bytes)["branch"]
        wanted: list[tuple[str, bytes]] = []
        while isinstance(branch, str) and branch != lineage.MAIN:
            rel = f"{branch_rel(branch)}/{lineage.BRANCH_RECORD}"
            data = tier.fs.cat_file(tier.key("", rel))
            wanted.append((rel, data))
            branch = lineage.parse_id(json.loads(data)["parent"])[0]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return
    for rel, data in reversed(wanted):
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / rel, data)
    atomic_write_bytes(run_dir / lineage.HEAD_NAME, head_bytes)


# -- finding along a line -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Found:
    step: int
    branch: str
    directory: Path
    hot: CheckpointInfo | None
    cold: ColdCheckpoint | None

    @property
    def id(self) -> str:
        return lineage.checkpoint_id(self.branch, self.step)


def along_line(run_dir: Path, branch: str, tier: ColdTier | None) -> list[Found]:
    """Every checkpoint a start on `branch` may resume from, newest first: the branch's own, then
    its parent branch's up to the branch point, and so on (hot and cold joined by name)."""
    out: list[Found] = []
    for b, limit in lineage.line_of(run_dir, branch):
        hot = {i.path.name: i for i in list_checkpoints(b.directory) if limit is None or i.step <= limit}
        cold = {c.name: c for c in (tier.list(branch_rel(b.name)) if tier is not None else [])
                if limit is None or c.step <= limit}
        steps = {n: (hot[n].step if n in hot else cold[n].step) for n in set(hot) | set(cold)}
        for name in sorted(steps, key=lambda n: (steps[n], n), reverse=True):
            out.append(Found(steps[name], b.name, b.directory, hot.get(name), cold.get(name)))
    return out


def materialize(found: Found, tier: ColdTier | None) -> Path:
    """The hot path of `found`, fetching it (and the chain it needs) from the cold tier if it is
    not hot or its hot copy fails to verify."""
    if found.hot is not None:
        try:
            verify(found.hot)
            return found.hot.path
        except CheckpointError as exc:
            if found.cold is None or tier is None:
                raise
            warnings.warn(f"hot copy {found.hot.path} failed ({exc}); fetching the cold copy", CheckpointSkippedWarning,
                          stacklevel=3)
    assert found.cold is not None and tier is not None
    rel = branch_rel(found.branch)
    listed = {c.name: c for c in tier.list(rel)}
    for name in reversed(found.cold.needs):
        needed = listed.get(name)
        if needed is None:
            raise chain.BrokenChainError(tier.where(rel, name), f"needed by {found.cold.name} but not committed in the "
                                                                 "cold tier")
        tier.fetch(needed, found.directory, rel)
    return found.directory / found.cold.name


class StoreLock:
    """The lock a save and a pass's deletions take (a sweep must never see a save's pieces before
    its manifest). It keeps how long each thread waited for it: the training thread's waits are
    what a demotion costs a blocking save (reference.bench)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.waited_s: dict[int, float] = {}

    def __enter__(self):
        import time
        t0 = time.perf_counter()
        self._lock.acquire()
        me = threading.get_ident()
        self.waited_s[me] = self.waited_s.get(me, 0.0) + time.perf_counter() - t0
        return self

    def __exit__(self, *exc):
        self._lock.release()


class Worker:
    """One background thread for the cold tier's passes: a request while a pass runs makes one
    more run after it (never two at once, never a request lost); a pass's error is kept and
    raised by the next `raise_error()` or `wait()`."""

    def __init__(self, work):
        self._work = work
        self._lock = threading.Lock()
        self._executor = None
        self._future = None
        self._running = self._again = False
        self._error: BaseException | None = None
        self.request_s = 0.0      # time callers spent in request(): what asking for a pass costs them

    def request(self) -> None:
        import time
        t0 = time.perf_counter()
        try:
            self._request()
        finally:
            self.request_s += time.perf_counter() - t0

    def _request(self) -> None:
        from concurrent.futures import ThreadPoolExecutor
        with self._lock:
            if self._running:
                self._again = True
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-tier")
            self._future = self._executor.submit(self._loop)   # raises (e.g. at interpreter exit): not running
            self._running = True

    def _loop(self) -> None:
        while True:
            try:
                self._work()
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc     # the first one is raised; a later pass may succeed
                    if not self._again:
                        self._running = False
                        return
                    self._again = False
                continue
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False

    def wait(self) -> None:
        while True:
            with self._lock:
                future = self._future
            if future is None:
                break
            future.result()
            with self._lock:
                if self._future is future and not self._running:
                    break
        self.raise_error()

    def raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
