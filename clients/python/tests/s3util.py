"""A real MinIO server for the S3 dataset test, and just enough S3 to fill it.

The binary is the one scripts/minio.sh installs: $MINIO_BIN, else GOBIN or
GOPATH/bin, else PATH (the rule of internal/miniotest). Objects are put
with a minimal SigV4 signer so the tests need no boto3.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import http.client
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

REGION = "us-east-1"


def minio_binary() -> str | None:
    """The MinIO server binary, or None when it is not installed."""
    if p := os.environ.get("MINIO_BIN"):
        return p
    dirs = []
    try:
        out = subprocess.run(
            ["go", "env", "GOBIN", "GOPATH"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if out and out[0]:
            dirs.append(out[0])
        if len(out) > 1:
            dirs += [os.path.join(p, "bin") for p in out[1].split(os.pathsep) if p]
    except (OSError, subprocess.CalledProcessError):
        pass
    for d in dirs:
        p = os.path.join(d, "minio")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("minio")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MinIO:
    """A MinIO server on 127.0.0.1 with fresh random root credentials."""

    def __init__(self, binary: str, data: Path) -> None:
        self.access_key = "ckptd-" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MINIO_", "AWS_"))}
        env |= {
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "MINIO_CI_CD": "1",
        }
        self.log = data.parent / "minio.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, "server", "--quiet", "--address", f"127.0.0.1:{self.port}",
                 "--console-address", f"127.0.0.1:{_free_port()}", str(data)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minio exited ({self.proc.returncode}): {self.log.read_text()}")
            # An authenticated request, not /minio/health/ready: MinIO
            # answers ready before it takes requests (503
            # XMinioServerNotInitialized), as the Go suite's waitReady knows.
            try:
                self.request("GET", "/", timeout=2)
                return
            except (OSError, RuntimeError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"minio not ready after 60s: {self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def request(self, method: str, path: str, body: bytes = b"", timeout: float = 30) -> None:
        """One signed request; raises on a status other than 2xx."""
        headers = sign(method, f"127.0.0.1:{self.port}", path, body, self.access_key,
                       self.secret_key)  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request(method, urllib.parse.quote(path), body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read()
        if resp.status // 100 != 2:
            raise RuntimeError(f"{method} {path}: {resp.status} {text[:500]!r}")

    def make_bucket(self, bucket: str) -> None:
        self.request("PUT", f"/{bucket}")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.request("PUT", f"/{bucket}/{key}", data)


def sign(method: str, host: str, path: str, body: bytes, ak: str, sk: str) -> dict[str, str]:
    """The headers of an AWS Signature Version 4 request (no query string)."""
    now = dt.datetime.now(dt.timezone.utc)
    amz_date, date = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [method, urllib.parse.quote(path), "", *(f"{k}:{headers[k]}" for k in sorted(headers)),
         "", signed, payload]
    )  # fmt: skip
    scope = f"{date}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + sk).encode()
    for part in (date, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={ak}/{scope}, SignedHeaders={signed}, Signature={sig}"
    )
    return headers
