"""Open a checkpoint store ("cold storage") through fsspec so an unreachable store fails fast.

    fs, root = open_cold("s3://bucket/run-7", timeout_s=10)   # no network yet
    check_reachable(fs, root, "s3://bucket/run-7", timeout_s=10)   # bounded probe, or ColdStorageError
    fs.pipe_file(f"{root}/step-100/index.json", data)

S3 (s3fs on aiobotocore) gets, on every call:
- botocore ``connect_timeout`` and ``read_timeout`` = timeout_s (s3fs's defaults are 5 s and 15 s);
- botocore retries ``{"total_max_attempts": attempts, "mode": "standard"}``: throttling, 5xx and
  connection errors are retried with jittered backoff. NB botocore's ``max_attempts`` key counts
  *retries* (max_attempts=1 is two requests); ``total_max_attempts`` counts requests;
- s3fs's own retry loop (``S3FileSystem.retries``, a class attribute, 5 by default, not a constructor
  argument) set to 1 on the instance: s3fs re-runs a call whose botocore attempts all timed out, so the
  defaults multiply (5 s3fs tries x 5 legacy botocore attempts x 15 s read timeout against a silent server).
  The price: s3fs no longer retries a body read cut short (IncompleteRead) by itself.
So one call against a dead store costs at most about attempts x timeout_s plus a few seconds of backoff;
check_reachable bounds its probe to timeout_s in total (fsspec's sync timeout cancels the coroutine).

Endpoint and credentials: ``storage_options`` (endpoint_url, key, secret, client_kwargs={"region_name"})
win; otherwise botocore reads the environment (AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), which is how a trainer subprocess is pointed
at a store.

Stale listings: s3fs caches listings (``dircache``) per instance, and fsspec shares instances between
callers with equal arguments, so objects written by another process could stay invisible. open_cold
passes ``use_listings_cache=False`` (the dircache never stores anything: each ls/info/exists/find asks the
store) and ``skip_instance_cache=True`` (a fresh instance per call); check_reachable also calls
``fs.invalidate_cache()``. A caller who turns the cache back on must call ``fs.invalidate_cache(path)``
before every listing that must see other writers.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.asyn import sync
from fsspec.core import split_protocol

S3_PROTOCOLS = ("s3", "s3a")


class ColdStorageError(OSError):
    """The store behind `url` cannot be used: unknown scheme, unreachable, missing bucket, denied."""

    def __init__(self, url: str, problem: str):
        self.url = url
        self.problem = problem
        super().__init__(f"{url}: {problem}")

    def __reduce__(self):
        return (type(self), (self.url, self.problem))


def open_cold(url: str, *, timeout_s: float = 10.0, storage_options: dict[str, Any] | None = None,
              attempts: int = 3) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path inside it) for `url`; no network traffic yet (see check_reachable).

    "s3://bucket/prefix" -> (S3FileSystem, "bucket/prefix"); "file:///tmp/x" -> (LocalFileSystem, "/tmp/x");
    "memory://x" -> (MemoryFileSystem, "/x"). `storage_options` go to the filesystem; for s3 its
    `config_kwargs` entries override the timeouts set here.
    """
    if timeout_s <= 0 or attempts < 1:
        raise ValueError(f"timeout_s must be > 0 and attempts >= 1, not {timeout_s!r} and {attempts!r}")
    if "::" in url:
        raise ColdStorageError(url, "chained URLs are not supported (a caching layer would hide other writers)")
    protocol = split_protocol(url)[0] or "file"
    opts = dict(storage_options or {})
    if protocol in S3_PROTOCOLS:
        config = {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                  "retries": {"total_max_attempts": attempts, "mode": "standard"}}
        config.update(opts.pop("config_kwargs", None) or {})
        opts["config_kwargs"] = config
        opts.setdefault("use_listings_cache", False)
        opts["skip_instance_cache"] = True
    elif protocol in ("file", "local"):
        opts.setdefault("auto_mkdir", True)   # like s3: writing a/b/c needs no mkdir of a/b first
    try:
        fs, root = fsspec.url_to_fs(url, **opts)
    except ValueError as e:   # "Protocol not known: ..."
        raise ColdStorageError(url, f"unknown storage scheme {protocol!r} ({e})") from e
    except ImportError as e:  # known to fsspec, implementation not installed (gcsfs, adlfs, ...)
        raise ColdStorageError(url, f"scheme {protocol!r} needs a package that is not installed ({e})") from e
    if protocol in S3_PROTOCOLS:
        fs.retries = 1   # instance attribute; the instance is not shared (skip_instance_cache)
    return fs, root


def check_reachable(fs: fsspec.AbstractFileSystem, root: str, url: str, *, timeout_s: float = 10.0) -> None:
    """Prove within `timeout_s` (in total) that the store answers for `root`, or raise ColdStorageError.

    s3: HeadBucket (bucket exists, credentials accepted) then a one-key ListObjectsV2 under the prefix
    (listing allowed). Read-only: the prefix need not exist yet. Other stores: `root` is created
    (makedirs) and listed, in a daemon thread abandoned at the deadline.
    """
    fs.invalidate_cache()
    if set(_protocols(fs)) & set(S3_PROTOCOLS):
        _check_s3(fs, root, url, timeout_s)
        return

    def probe():
        fs.makedirs(root, exist_ok=True)
        try:
            fs.ls(root, detail=False)
        except FileNotFoundError:   # an object store behind a wrapper: an empty prefix is no directory
            pass

    try:
        _in_thread(probe, timeout_s)
    except TimeoutError:
        raise ColdStorageError(url, f"no answer from the store within {timeout_s:g} s") from None
    except Exception as e:
        raise ColdStorageError(url, f"store not usable: {type(e).__name__}: {e}") from e


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _check_s3(fs, root: str, url: str, timeout_s: float) -> None:
    bucket, key, _ = fs.split_path(root)
    if not bucket:
        raise ColdStorageError(url, "the URL names no bucket")
    seen: dict[str, str] = {}

    def note_attempt(caught_exception=None, **_):   # botocore's retry hook: remember why attempts fail
        if caught_exception is not None:
            seen["last"] = f"{type(caught_exception).__name__}: {caught_exception}"

    async def probe():
        await fs.set_session()   # credential lookup may touch the network (IMDS): inside the deadline
        seen["endpoint"] = fs._s3.meta.endpoint_url
        events = fs._s3.meta.events
        events.register("needs-retry.s3", note_attempt, unique_id="coldfs-probe")
        try:
            await fs._call_s3("head_bucket", Bucket=bucket)
            await fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
        finally:
            events.unregister("needs-retry.s3", unique_id="coldfs-probe")

    try:
        sync(fs.loop, probe, timeout=timeout_s)
    except Exception as e:
        endpoint = seen.get("endpoint") or fs.endpoint_url or "the endpoint from the environment"
        if isinstance(e, TimeoutError):   # fsspec's FSTimeoutError (our deadline) is a TimeoutError
            problem = f"no answer from S3 endpoint {endpoint} within {timeout_s:g} s"
            if "last" in seen:
                problem += f" (last attempt: {seen['last']})"
        elif isinstance(e, FileNotFoundError):
            problem = f"bucket {bucket!r} does not exist at S3 endpoint {endpoint}"
        elif isinstance(e, PermissionError):
            problem = f"access to bucket {bucket!r} denied at S3 endpoint {endpoint} (check credentials): {e}"
        elif type(e).__name__ == "NoCredentialsError":
            problem = (f"no S3 credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or pass "
                       f"key/secret in storage_options) for endpoint {endpoint}")
        else:
            problem = f"S3 endpoint {endpoint} unreachable or failing: {type(e).__name__}: {e}"
        raise ColdStorageError(url, problem) from e


def _in_thread(fn: Callable[[], object], timeout_s: float) -> None:
    """Run fn in a daemon thread; TimeoutError if it has not finished after timeout_s (it keeps running)."""
    box: dict[str, BaseException] = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="coldfs-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"probe still running after {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
