"""Helpers of the dataset tests: WebDataset shards written with tarfile."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

Fields = dict[str, bytes]


def shard_bytes(samples: dict[str, Fields]) -> bytes:
    """A WebDataset tar: each sample's fields as consecutive members key.ext."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for key, fields in samples.items():
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_samples(shard: int, per: int, size: int = 0) -> dict[str, Fields]:
    """per samples with a cls, a txt that names the key, and size extra bytes in bin."""
    out = {}
    for i in range(per):
        key = f"s{shard:03d}/{i:04d}"
        fields = {"cls": str(i % 7).encode(), "txt": f"{key} ".encode() * (3 + i % 5)}
        if size:
            fields["bin"] = (key.encode() + b"\x00") * (size // (len(key) + 1) + 1)
        out[key] = fields
    return out


def write_shards(
    folder: Path, n: int, per: int, size: int = 0, name: str = "train-{:03d}.tar"
) -> dict[str, Fields]:
    """Write n shards of per samples into folder; return every sample's fields by key."""
    folder.mkdir(parents=True, exist_ok=True)
    want: dict[str, Fields] = {}
    for s in range(n):
        samples = make_samples(s, per, size)
        (folder / name.format(s)).write_bytes(shard_bytes(samples))
        want |= samples
    return want


def keys(batches: list[list[dict]]) -> list[str]:
    """The keys of a list of batches, in order."""
    return [s["__key__"] for b in batches for s in b]
