"""The client's copies of the daemon's limits (ckptd._limits) equal the Go constants."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptd import _limits

REPO = Path(__file__).resolve().parents[3]

# (Python name, Go file, Go constant)
COPIES = [
    ("MAX_METADATA", "checkpoint/staging/save.go", "MaxMetadata"),
    ("MAX_NAME_BYTES", "checkpoint/names.go", "MaxNameLen"),
    ("MAX_MESSAGE", "proto/ckptd/v1/limits.go", "MaxMessageBytes"),
    ("STREAM_CHUNK", "proto/ckptd/v1/limits.go", "StreamChunkBytes"),
]


def go_const(path: str, name: str) -> int:
    src = (REPO / path).read_text()
    m = re.search(rf"\b{name}\s*=\s*([0-9_]+)(?:\s*<<\s*([0-9]+))?", src)
    assert m, f"{name} not found in {path}"
    value = int(m.group(1).replace("_", ""))
    return value << int(m.group(2)) if m.group(2) else value


@pytest.mark.parametrize(("py", "path", "go"), COPIES)
def test_limit_matches_daemon(py: str, path: str, go: str) -> None:
    assert getattr(_limits, py) == go_const(path, go), (
        f"ckptd._limits.{py} differs from {go} in {path}"
    )
