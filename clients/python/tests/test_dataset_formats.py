"""Client.dataset over the formats other libraries write: Mosaic streaming's MDS, Parquet.

Each dataset is written by the real library and read through a real daemon,
every sample's every field checked against what the library wrote.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

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
