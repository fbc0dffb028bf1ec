"""Client.dataset over the formats other libraries write: Mosaic streaming's MDS, Parquet.

Each dataset is written by the real library (pyarrow here; MDSWriter's
files are checked in) and read through a real daemon, every sample's every
field checked against what the library wrote.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ckptd

# Written by mosaicml-streaming's own MDSWriter (prefetch/testdata/mds/make.py
# says how): streaming pins numpy<2.2, which this environment's numpy 2.4
# excludes, so the datasets are checked in rather than written here.
MDS = Path(__file__).resolve().parents[3] / "prefetch" / "testdata" / "mds"


@pytest.fixture
def dc(dataset_daemon):
    with dataset_daemon.client() as c:
        yield c


def read_all(c: ckptd.Client, spec: ckptd.DatasetSpec) -> dict[str, dict]:
    got: dict[str, dict] = {}
    with c.dataset(spec) as ds:
        for batch in ds:
            for s in batch:
                assert s["__key__"] not in got
                got[s["__key__"]] = s
    return got


@pytest.mark.parametrize("codec", ["plain", "zstd", "gz", "bz2", "br", "snappy"])
def test_mds_written_by_mosaic(dc, tmp_path, codec):
    folder = tmp_path / codec
    shutil.copytree(MDS / codec, folder)
    want = json.loads((folder / "expected.json").read_text())
    for fmt in ("mds", "auto"):
        got = read_all(dc, ckptd.DatasetSpec(folder, format=fmt, batch_size=5, seed=3))
        assert sorted(got, key=int) == [str(i) for i in range(len(want))]
        for i, columns in enumerate(want):
            sample = got[str(i)]
            assert sample.keys() == {"__key__", *columns}
            for name, b64 in columns.items():
                assert sample[name] == base64.b64decode(b64), (codec, i, name)


def test_mds_across_ranks(dc, tmp_path):
    folder = tmp_path / "zstd"
    shutil.copytree(MDS / "zstd", folder)
    n = len(json.loads((folder / "expected.json").read_text()))
    seen: list[str] = []
    for rank in range(3):
        spec = ckptd.DatasetSpec(folder, format="mds", rank=rank, world_size=3, even="off")
        seen += list(read_all(dc, spec))
    assert sorted(seen, key=int) == [str(i) for i in range(n)]


def test_unknown_format_is_refused(dc, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(MDS / "plain", folder)
    with pytest.raises(ckptd.InvalidArgumentError, match="unknown format"):
        read_all(dc, ckptd.DatasetSpec(folder, format="lance"))


ROWS = 45


def parquet_table(offset: int) -> pa.Table:
    n = range(offset, offset + ROWS)
    return pa.table(
        {
            "label": pa.array([i % 10 for i in n], pa.int64()),
            "caption": pa.array([None if i % 7 == 3 else f"caption {i}" for i in n], pa.string()),
            "jpg": pa.array([bytes([i % 256]) * (i % 300) for i in n], pa.binary()),
            "ids": pa.array([list(range(i, i + i % 5)) for i in n], pa.list_(pa.int32())),
            "image": pa.array(
                [{"bytes": b"\xff\xd8" * (i % 4), "path": f"{i}.jpg"} for i in n],
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
        }
    )


def parquet_fields(i: int) -> dict[str, bytes]:
    """The fields ckptd delivers for row i: numbers little endian, a list's values in turn."""
    out = {
        "label": struct.pack("<q", i % 10),
        "jpg": bytes([i % 256]) * (i % 300),
        "ids": b"".join(struct.pack("<i", j) for j in range(i, i + i % 5)),
        "image.bytes": b"\xff\xd8" * (i % 4),
        "image.path": f"{i}.jpg".encode(),
        "caption": f"caption {i}".encode(),
    }
    if i % 7 == 3:
        del out["caption"]  # a null is no field
    if not out["ids"]:
        del out["ids"]  # nor is an empty list (an empty bytes value is a field)
    return out


@pytest.mark.parametrize("compression", ["snappy", "zstd", "gzip", "none"])
def test_parquet_written_by_pyarrow(dc, tmp_path, compression):
    folder = tmp_path / "pq"
    folder.mkdir()
    for f in range(3):
        pq.write_table(
            parquet_table(f * ROWS),
            folder / f"train-{f:05}.parquet",
            row_group_size=10,
            compression=compression,
            data_page_version="2.0" if f == 1 else "1.0",
        )
    for fmt in ("parquet", "auto"):
        with dc.dataset(ckptd.DatasetSpec(folder, format=fmt, batch_size=7, seed=1)) as ds:
            assert ds.shards == 3 * 5  # a row group each
            got = {s["__key__"]: s for batch in ds for s in batch}
        assert len(got) == 3 * ROWS
        for f in range(3):
            for r in range(ROWS):
                sample = got[f"train-{f:05}/{r}"]
                want = parquet_fields(f * ROWS + r)
                assert sample.keys() == {"__key__", *want}, (f, r)
                for name, value in want.items():
                    assert sample[name] == value, (compression, f, r, name)


def test_parquet_row_groups_dealt_to_ranks(dc, tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(parquet_table(0), folder / "one.parquet", row_group_size=5)
    seen: list[str] = []
    for rank in range(4):  # one file of 9 row groups, shared by 4 ranks
        spec = ckptd.DatasetSpec(folder, format="parquet", rank=rank, world_size=4, even="off")
        seen += list(read_all(dc, spec))
    assert sorted(seen) == sorted(f"one/{r}" for r in range(ROWS))
