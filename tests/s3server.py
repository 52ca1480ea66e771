"""A loopback S3 server (moto) for tests, and a pytest fixture for it.

In a test module:

    from tests.s3server import moto_s3  # noqa: F401  (the fixture: a server + bucket for the session)

    def test_x(moto_s3):
        fs, root = open_cold(moto_s3.url("run-1"), storage_options=moto_s3.storage_options)
        subprocess.run([...], env={**os.environ, **moto_s3.env})   # a trainer finds the store by env

Or `moto_s3_fixture(bucket=..., region=..., scope=..., name=...)` for another bucket/region/scope, or
`running_moto_s3()` as a context manager outside pytest. Nothing here touches os.environ: credentials
and the endpoint travel in `.storage_options` (in-process) and `.env` (subprocesses).

Notes: the server is moto's ThreadedMotoServer, a thread in this process (werkzeug, one thread per
request). Its state lives in moto's process-global in-memory backend, which outlives server.stop() and
is shared by every moto server in the process: a bucket made through one server is visible (and already
exists) through the next. So the default bucket name is unique per server, and teardown empties and
deletes the buckets a server made. A session-scoped fixture imported into two test modules is two
fixture definitions, so two servers (import it in a conftest.py to share one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint: str   # "http://127.0.0.1:PORT"
    bucket: str
    region: str = "us-east-1"
    key: str = ACCESS_KEY
    secret: str = SECRET_KEY
    made: list[str] = dataclasses.field(default_factory=list, repr=False, compare=False)  # buckets to clean up

    def url(self, prefix: str = "") -> str:
        """"s3://bucket/prefix" (no trailing slash)."""
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    @property
    def env(self) -> dict[str, str]:
        """What a subprocess needs to reach this server through botocore's environment lookup. Overlay it on
        os.environ; the service-specific AWS_ENDPOINT_URL_S3 is set too because botocore prefers it."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": self.region}

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs/fsspec options for this server (a fresh dict each time)."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret,
                "client_kwargs": {"region_name": self.region}}

    def client(self):
        """A plain (synchronous) botocore S3 client for this server, for setup and direct checks."""
        import botocore.session
        from botocore.config import Config
        return botocore.session.Session().create_client(
            "s3", region_name=self.region, endpoint_url=self.endpoint,
            aws_access_key_id=self.key, aws_secret_access_key=self.secret,
            config=Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 2, "mode": "standard"}))

    def make_bucket(self, bucket: str) -> S3Server:
        """Create another bucket on the same server; the returned S3Server points at it."""
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.region != "us-east-1":   # us-east-1 rejects a LocationConstraint; every other region needs one
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self.client().create_bucket(**kwargs)
        self.made.append(bucket)
        return dataclasses.replace(self, bucket=bucket)

    def cleanup(self) -> None:
        """Empty and delete the buckets made through this server (moto's state outlives the server)."""
        client = self.client()
        for bucket in self.made:
            for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
                gone = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                        for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
                if gone:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": gone, "Quiet": True})
            client.delete_bucket(Bucket=bucket)
        self.made.clear()


@contextlib.contextmanager
def running_moto_s3(*, bucket: str | None = None, region: str = "us-east-1") -> Iterator[S3Server]:
    """Start moto on 127.0.0.1 with an OS-chosen port, create `bucket` (default: "cold-test-<random>"),
    yield the S3Server; at exit delete what it made and stop the server."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()   # returns once the socket is bound (make_server), so the port is known and accepting
    try:
        host, port = server.get_host_and_port()   # the real port; port=0 was only a request
        s3 = S3Server(endpoint=f"http://{host}:{port}", bucket="", region=region)
        s3 = s3.make_bucket(bucket or f"cold-test-{uuid.uuid4().hex[:8]}")
        try:
            yield s3
        finally:
            s3.cleanup()
    finally:
        server.stop()


def moto_s3_fixture(*, bucket: str | None = None, region: str = "us-east-1", scope: str = "session",
                    name: str = "moto_s3"):
    """A pytest fixture yielding an S3Server; bind it in a test module or conftest under `name`."""

    @pytest.fixture(scope=scope, name=name)
    def _fixture(require_extras) -> Iterator[S3Server]:
        require_extras("s3-test", "cold")   # moto, the server; s3fs, the client
        with running_moto_s3(bucket=bucket, region=region) as s3:
            yield s3

    return _fixture


@pytest.fixture(scope="session")
def moto_s3(require_extras) -> Iterator[S3Server]:
    """Session-wide moto S3 on loopback, one fresh bucket in us-east-1; use a unique prefix per test."""
    require_extras("s3-test", "cold")   # moto, the server; s3fs, the client
    with running_moto_s3() as s3:
        yield s3
