"""reference/cold/fs.py against a loopback moto S3 server (tests/s3server.py) and the local filesystem."""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from resume_conformance.reference.cold.fs import ColdStorageError, check_reachable, open_cold

# The fixture (a moto server + bucket for this module); parameters named moto_s3 then read as F811.
from tests.s3server import moto_s3  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 5.0


def _open(url, **storage_options):
    fs, root = open_cold(url, timeout_s=TIMEOUT, storage_options=storage_options)
    check_reachable(fs, root, url, timeout_s=TIMEOUT)
    return fs, root


def test_s3_round_trip(moto_s3):  # noqa: F811
    fs, root = _open(moto_s3.url("round-trip/run"), **moto_s3.storage_options)
    assert type(fs).__name__ == "S3FileSystem" and root == f"{moto_s3.bucket}/round-trip/run"
    data = os.urandom(4096)
    path = f"{root}/step-1/model.bin"
    fs.pipe_file(path, data)
    assert fs.cat_file(path) == data
    assert fs.ls(f"{root}/step-1", detail=False) == [path]
    info = fs.info(path)
    assert info["size"] == len(data)
    assert info["ETag"].strip('"') == hashlib.md5(data).hexdigest()   # single-part upload: ETag is the MD5
    with fs.open(f"{root}/step-1/meta.json", "wb") as f:
        f.write(b"{}")
    assert sorted(fs.find(root)) == [f"{root}/step-1/meta.json", path]
    fs.rm(f"{root}/step-1", recursive=True)
    assert not fs.exists(path)
    assert fs.find(root) == []


def test_subprocess_reaches_store_through_env_and_listings_are_fresh(moto_s3):  # noqa: F811
    url = moto_s3.url("subprocess/run")
    fs, root = _open(url, **moto_s3.storage_options)
    fs.pipe_file(f"{root}/from-parent", b"parent")
    assert fs.ls(root, detail=False) == [f"{root}/from-parent"]   # listed once: a cache would now be stale
    child = (
        "import sys\n"
        "from resume_conformance.reference.cold.fs import check_reachable, open_cold\n"
        "fs, root = open_cold(sys.argv[1], timeout_s=5)\n"   # no storage_options: endpoint, keys from env
        "check_reachable(fs, root, sys.argv[1], timeout_s=5)\n"
        "print(fs.s3.meta.endpoint_url, fs.cat_file(root + '/from-parent').decode())\n"
        "fs.pipe_file(root + '/from-child', b'child')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(moto_s3.env)
    proc = subprocess.run([sys.executable, "-c", child, url], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [moto_s3.endpoint, "parent"]
    assert fs.ls(root, detail=False) == [f"{root}/from-child", f"{root}/from-parent"]
    assert fs.cat_file(f"{root}/from-child") == b"child"


def test_unknown_scheme():
    with pytest.raises(ColdStorageError) as err:
        open_cold("nosuchscheme://bucket/x")
    assert err.value.url == "nosuchscheme://bucket/x"
    assert "nosuchscheme" in err.value.problem and str(err.value).startswith("nosuchscheme://bucket/x: ")
    with pytest.raises(ColdStorageError, match="chained"):
        open_cold("simplecache::s3://bucket/x")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.needs_extra("cold")
def test_unreachable_endpoint_fails_fast():
    endpoint = f"http://127.0.0.1:{_closed_port()}"   # nothing listens there: connection refused
    start = time.monotonic()
    with pytest.raises(ColdStorageError) as err:
        fs, root = open_cold("s3://bucket/x", timeout_s=1,
                             storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"})
        check_reachable(fs, root, "s3://bucket/x", timeout_s=1)
    assert time.monotonic() - start < 30
    assert endpoint in str(err.value) and err.value.url == "s3://bucket/x"


@pytest.mark.needs_extra("cold")
def test_silent_endpoint_fails_fast():
    """A server that accepts connections and never answers: the case that hangs with default settings."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        accepted = []
        threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        fs, root = open_cold("s3://bucket/x", timeout_s=1,
                             storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"})
        start = time.monotonic()
        with pytest.raises(ColdStorageError, match="no answer"):
            check_reachable(fs, root, "s3://bucket/x", timeout_s=1)
        assert time.monotonic() - start < 30
        for conn, _ in accepted:
            conn.close()


def test_missing_bucket(moto_s3):  # noqa: F811
    url = "s3://no-such-bucket-here/x"
    fs, root = open_cold(url, timeout_s=TIMEOUT, storage_options=moto_s3.storage_options)
    with pytest.raises(ColdStorageError, match="bucket 'no-such-bucket-here' does not exist") as err:
        check_reachable(fs, root, url, timeout_s=TIMEOUT)
    assert err.value.url == url and moto_s3.endpoint in err.value.problem


def test_local_round_trip(tmp_path):
    url = (tmp_path / "cold").as_uri()   # file:///...
    fs, root = _open(url)
    assert root == str(tmp_path / "cold") and (tmp_path / "cold").is_dir()   # check_reachable made it
    path = f"{root}/step-1/model.bin"   # parent directory made on write (auto_mkdir)
    fs.pipe_file(path, b"weights")
    assert fs.cat_file(path) == b"weights"
    assert fs.ls(f"{root}/step-1", detail=False) == [path]
    fs.rm(f"{root}/step-1", recursive=True)
    assert fs.ls(root, detail=False) == []


def test_memory_round_trip():
    fs, root = _open("memory://coldfs-test")
    fs.pipe_file(f"{root}/a", b"x")
    assert fs.cat_file(f"{root}/a") == b"x"
    fs.rm(root, recursive=True)
