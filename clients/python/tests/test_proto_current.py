"""The generated stubs in src/ckptd/v1 match proto/ (CI fails when stale)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from slow import scaled

REPO = Path(__file__).resolve().parents[3]
GENERATED = ("ckptd_pb2.py", "ckptd_pb2.pyi", "ckptd_pb2_grpc.py")


def test_generated_stubs_are_current(tmp_path):
    if not (REPO / ".venv" / "bin" / "python").exists() and not os.environ.get("CI"):
        pytest.skip("needs the repository's .venv (scripts/tools.sh makes it)")
    gen = subprocess.run(
        [str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert gen.returncode == 0, gen.stderr
    for name in GENERATED:
        want = (tmp_path / "clients/python/src/ckptd/v1" / name).read_bytes()
        got = (REPO / "clients/python/src/ckptd/v1" / name).read_bytes()
        assert got == want, (
            f"clients/python/src/ckptd/v1/{name} is stale: run `make proto` and commit the result"
        )
