"""Datasets from S3: shards in a real MinIO, read through `ckptd serve --s3-endpoint`.

Skipped when MinIO is not installed (scripts/minio.sh installs it), which
fails under CI like every skip.
"""

from __future__ import annotations

import time

import pytest
from s3util import REGION, MinIO, minio_binary
from slow import scaled
from wds import make_samples, shard_bytes

import ckptd

SHARDS, PER, BATCH = 5, 12, 8


@pytest.fixture
def minio(tmp_path):
    binary = minio_binary()
    if binary is None:
        pytest.skip("minio is not installed (run scripts/minio.sh)")
    server = MinIO(binary, tmp_path / "minio")
    yield server
    server.stop()


@pytest.fixture
def s3_daemon(minio, make_daemon, monkeypatch):
    """A daemon whose S3 endpoint and credentials are the MinIO's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio.secret_key)
    monkeypatch.setenv("AWS_REGION", REGION)
    return make_daemon(
        "--s3-endpoint", minio.endpoint, "--slot-bytes", "256KiB", "--dataset-allow", "s3://data,s3://bad",
        "--cache-bytes", "8MiB", "--cache-memory-at-start",  # the default, which conftest turns off
    )  # fmt: skip


def upload(minio: MinIO, bucket: str, prefix: str, corrupt: int | None = None) -> dict:
    minio.make_bucket(bucket)
    want = {}
    for s in range(SHARDS):
        samples = make_samples(s, PER)
        body = shard_bytes(samples)
        if s == corrupt:
            body = body[: len(body) // 2]
        else:
            want |= samples
        minio.put(bucket, f"{prefix}/train-{s:03d}.tar", body)
    minio.put(bucket, f"{prefix}/README.txt", b"not a shard")
    minio.put(bucket, "other/train-999.tar", shard_bytes(make_samples(999, 3)))  # not under prefix
    return want


def test_s3_dataset_exactly_once_cached_and_resumable(minio, s3_daemon):
    want = upload(minio, "data", "train")
    source = "s3://data/train"
    with s3_daemon.client() as c:
        per_rank = []
        for rank in range(2):
            with c.dataset(
                ckptd.DatasetSpec(
                    source, batch_size=BATCH, rank=rank, world_size=2, seed=1, even="off"
                )
            ) as ds:
                assert ds.shards in (2, 3)
                batch_list = list(ds)
                per_rank.append([s["__key__"] for b in batch_list for s in b])
                for b in batch_list:
                    for s in b:
                        assert s["txt"] == want[s["__key__"]]["txt"]
                        assert s["cls"] == want[s["__key__"]]["cls"]
                first = ds.stats()
        flat = per_rank[0] + per_rank[1]
        assert len(flat) == len(set(flat)) == len(want)
        assert first.cache_misses > 0

        with c.dataset(
            ckptd.DatasetSpec(
                source, batch_size=BATCH, rank=0, world_size=2, seed=1, start=5, even="off"
            )
        ) as ds:
            assert [s["__key__"] for b in ds for s in b] == per_rank[0][5:]
            assert ds.stats().cache_hits > 0 and ds.stats().cache_misses == 0


def test_s3_corrupt_shard_and_empty_prefix(minio, s3_daemon):
    want = upload(minio, "bad", "train", corrupt=3)
    with s3_daemon.client() as c:
        with pytest.raises(ckptd.CorruptShardError, match=r"train-003\.tar"):
            list(c.dataset(ckptd.DatasetSpec("s3://bad/train", batch_size=BATCH)))
        with c.dataset(
            ckptd.DatasetSpec("s3://bad/train", batch_size=BATCH, skip_corrupt=True)
        ) as ds:
            got = [s["__key__"] for b in ds for s in b]
            assert ds.stats().corrupt_skipped == 1
        # the samples of train-003 before its cut are delivered, the rest skipped
        cut = sorted(k for k in got if k.startswith("s003/"))
        assert cut == [f"s003/{i:04d}" for i in range(len(cut))] and len(cut) < PER
        assert sorted(set(got) - set(cut)) == sorted(want)
        with pytest.raises(ckptd.InvalidArgumentError, match=r"no \.tar shards"):
            c.dataset(ckptd.DatasetSpec("s3://bad/nothing-here", batch_size=BATCH))
        with pytest.raises(ckptd.CkptdError, match="not beneath any source") as e:
            c.dataset(ckptd.DatasetSpec("s3://unlisted/train", batch_size=BATCH))
        assert e.value.code == "PERMISSION_DENIED"


def test_s3_shards_in_reused_memory_stay_intact(minio, request, monkeypatch):
    """Shards over 1 MiB land in the memory the daemon took at start, then in
    buffers evicted shards gave back (the cache holds a sixth of the dataset):
    over three shuffled epochs every sample keeps its own bytes. GOGC=1 hands
    buffers back as early as the daemon can, so that one handed back while a
    sample still used it would show."""
    monkeypatch.setenv("GOGC", "1")
    s3_daemon = request.getfixturevalue("s3_daemon")
    minio.make_bucket("data")
    want = {}
    for s in range(12):
        samples = make_samples(s, 4, size=600 << 10)  # 2.4 MiB shards
        want |= samples
        minio.put("data", f"big/train-{s:03d}.tar", shard_bytes(samples))
    deadline = time.monotonic() + scaled(30)
    while "dataset shard memory taken" not in s3_daemon.logs():
        assert time.monotonic() < deadline, s3_daemon.logs()
        time.sleep(0.01)
    with s3_daemon.client() as c:
        for epoch in range(3):
            spec = ckptd.DatasetSpec("s3://data/big", batch_size=4, epoch=epoch, shuffle_window=24)
            with c.dataset(spec) as ds:
                got = 0
                for b in ds:
                    for smp in b:
                        assert smp["bin"] == want[smp["__key__"]]["bin"], smp["__key__"]
                        got += 1
                assert got == len(want)
                assert ds.stats().cache_misses > 0
