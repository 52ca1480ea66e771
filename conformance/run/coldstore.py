"""The cold tier as the suite hands it to a trainer: an fsspec filesystem (`conformance-cold://`)
that forwards every call to the real store and records the ones that change it, so a crash point
in an upload or a demotion is data (`cold:N`, the Nth change) and replays exactly.

A trainer with capability `cold_tier` gets `CONFORMANCE_COLD_URL=conformance-cold://<root>` and
opens it with fsspec like any URL (the protocol is registered through the `fsspec.specs` entry
point, so nothing is imported by hand). What it does is steered by the environment:

    CONFORMANCE_COLD_TARGET    the real store's protocol: "file" (default) or "s3"
    CONFORMANCE_COLD_LOG       append one JSON line per change: {"n", "op", "path", "after_step"}
    CONFORMANCE_COLD_KILL_AT   SIGKILL this process just before change number N
    CONFORMANCE_COLD_GARBLE_AT let change number N happen, then flip one byte of the object it
                               wrote (a whole-object write: pipe_file, put_file, cp_file, mv) and
                               report success: a store that corrupts silently

Object-store calls are not syscalls under the checkpoint directory, so the strace recording does
not see them; this log is their recording. `after_step` is the number of lines in the trainer's
loss log when the call was made: the step the trainer had logged.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import fsspec
from fsspec.spec import AbstractFileSystem

PROTOCOL = "conformance-cold"
ENV_URL, ENV_TARGET, ENV_LOG, ENV_KILL_AT, ENV_GARBLE_AT = (
    "CONFORMANCE_COLD_URL", "CONFORMANCE_COLD_TARGET", "CONFORMANCE_COLD_LOG", "CONFORMANCE_COLD_KILL_AT",
    "CONFORMANCE_COLD_GARBLE_AT")
# The changes that write one whole object, which a garble fault can corrupt after the fact.
WHOLE_OBJECT_WRITES = ("pipe_file", "put_file", "cp_file", "mv")


@dataclasses.dataclass(frozen=True)
class ColdOp:
    n: int
    op: str
    path: str
    after_step: int


def read_log(path: Path) -> list[ColdOp]:
    """The recorded changes (a torn last line, from a kill, is ignored)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            out.append(ColdOp(int(rec["n"]), str(rec["op"]), str(rec["path"]), int(rec["after_step"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def url_for(root: str | os.PathLike) -> str:
    """The URL a trainer gets for a cold location at `root` (a local path, or bucket/prefix)."""
    root = os.fspath(root)
    return f"{PROTOCOL}://{root}"


class RecordingFileSystem(AbstractFileSystem):
    """Forwards to the real store; counts, logs and (when told) dies at the calls that change it."""

    protocol = PROTOCOL
    cachable = False
    _lock = threading.Lock()
    _count = 0           # per process: every instance counts into one sequence

    def __init__(self, *args, **kwargs):
        super().__init__()
        target = os.environ.get(ENV_TARGET, "file")
        self.inner = fsspec.filesystem(target, **({"auto_mkdir": True} if target == "file" else {}))
        self.log = os.environ.get(ENV_LOG)
        kill, garble = os.environ.get(ENV_KILL_AT), os.environ.get(ENV_GARBLE_AT)
        self.kill_at = int(kill) if kill else None
        self.garble_at = int(garble) if garble else None
        self.loss_log = os.environ.get("CONFORMANCE_LOSS_LOG")

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/") or "/"

    def _steps_logged(self) -> int:
        try:
            with open(self.loss_log, "rb") as f:
                return f.read().count(b"\n")
        except (OSError, TypeError):
            return 0

    def _change(self, op: str, path) -> int:
        """Count (and log) one change; die here if it is the one to be killed at. Its number."""
        with RecordingFileSystem._lock:
            RecordingFileSystem._count += 1
            n = RecordingFileSystem._count
            if self.log:
                line = json.dumps({"n": n, "op": op, "path": str(path), "after_step": self._steps_logged()})
                with open(self.log, "a") as f:
                    f.write(line + "\n")
            if self.kill_at is not None and n == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return n

    def _written(self, n: int, path) -> None:
        """After change `n` wrote the object at `path`: garble it if that is the fault asked for.
        The byte in the middle of the object has its low bit flipped; the size stays."""
        if n != self.garble_at:
            return
        key = self._strip_protocol(path)
        data = bytearray(self.inner.cat_file(key))
        if data:
            data[len(data) // 2] ^= 0x01
            self.inner.pipe_file(key, bytes(data))

    # -- changes --------------------------------------------------------------------------------
    def pipe_file(self, path, value, **kw):
        n = self._change("pipe_file", path)
        out = self.inner.pipe_file(self._strip_protocol(path), value, **kw)
        self._written(n, path)
        return out

    def put_file(self, lpath, rpath, **kw):
        n = self._change("put_file", rpath)
        out = self.inner.put_file(lpath, self._strip_protocol(rpath), **kw)
        self._written(n, rpath)
        return out

    def mv(self, path1, path2, **kw):
        n = self._change("mv", path2)
        out = self.inner.mv(self._strip_protocol(path1), self._strip_protocol(path2), **kw)
        self._written(n, path2)
        return out

    def cp_file(self, path1, path2, **kw):
        n = self._change("cp_file", path2)
        out = self.inner.cp_file(self._strip_protocol(path1), self._strip_protocol(path2), **kw)
        self._written(n, path2)
        return out

    def rm_file(self, path):
        self._change("rm_file", path)
        return self.inner.rm_file(self._strip_protocol(path))

    def rm(self, path, recursive=False, maxdepth=None):
        self._change("rm", path)
        return self.inner.rm(self._strip_protocol(path), recursive=recursive, maxdepth=maxdepth)

    def makedirs(self, path, exist_ok=False):
        return self.inner.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kw):
        return self.inner.mkdir(self._strip_protocol(path), create_parents=create_parents, **kw)

    def open(self, path, mode="rb", **kw):
        if any(c in mode for c in "wax+"):
            self._change(f"open({mode})", path)
        return self.inner.open(self._strip_protocol(path), mode, **kw)

    # -- reads ----------------------------------------------------------------------------------
    def ls(self, path, detail=True, **kw):
        return self.inner.ls(self._strip_protocol(path), detail=detail, **kw)

    def info(self, path, **kw):
        return self.inner.info(self._strip_protocol(path), **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        return self.inner.cat_file(self._strip_protocol(path), start=start, end=end, **kw)

    def get_file(self, rpath, lpath, **kw):
        return self.inner.get_file(self._strip_protocol(rpath), lpath, **kw)

    def exists(self, path, **kw):
        return self.inner.exists(self._strip_protocol(path), **kw)

    def invalidate_cache(self, path=None):
        self.inner.invalidate_cache(None if path is None else self._strip_protocol(path))


class LoopbackS3:
    """moto's S3 server on 127.0.0.1 (an OS-chosen port), for a suite run whose cold tier is
    `s3://bucket/...`: the bucket is made, and the endpoint and test credentials are put in this
    process's environment, which every trainer process inherits. `stop()` takes them back out."""

    def __init__(self, url: str):
        import boto3
        from moto.server import ThreadedMotoServer  # the s3-test extra
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            raise ValueError(f"cold tier URL {url!r} names no bucket")
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint,
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self._saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def stop(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.server.stop()
