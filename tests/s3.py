"""A real S3-compatible server for the artifact store's tests: moto's server
(`moto.server.ThreadedMotoServer`, the same HTTP API as S3) on 127.0.0.1 (or a given
address) and a free port.

The service talks to it through the production code path (pyarrow's S3 client, endpoint
from GANGSERVE_S3_ENDPOINT_URL); the tests check the bucket independently with boto3.
"""
from __future__ import annotations

import logging
from typing import Any

from harness.local import free_port

ACCESS_KEY = "AKIAGANGSERVETEST01"
SECRET_KEY = "gangserve-test-secret-0123456789"
REGION = "us-east-1"
# The AWS SDK inside pyarrow sends PUT bodies aws-chunked with a CRC64NVME trailer by
# default; moto 5.2 stores such a body undecoded (S3 and MinIO decode it). Asking for
# checksums only where an operation requires them is the SDK's documented switch, and a
# setting users of older S3-compatible servers need too (README, object storage).
SDK_ENV = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}


class MotoS3:
    """One moto S3 server; `start()` it, `bucket(name)` creates a bucket, `stop()` it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        """`host`: the address to listen on (a multi-node test gives its bridge's gateway)."""
        self.host = host
        self.port = free_port()
        self.endpoint = f"http://{host}:{self.port}"
        self._server: Any = None

    def start(self) -> "MotoS3":
        import os

        from moto.server import ThreadedMotoServer

        os.environ.update(SDK_ENV)  # this process's S3 clients (read by the SDK itself)

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        self._server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, url: str) -> dict[str, str]:
        """The environment a process needs to use `url` on this server."""
        return {"GANGSERVE_STORAGE_URL": url, "GANGSERVE_S3_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION,
                # Never ask an EC2 metadata service for credentials (would wait on a timeout).
                "AWS_EC2_METADATA_DISABLED": "true", **SDK_ENV}
