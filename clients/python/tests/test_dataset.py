"""Client.dataset against a real `ckptd serve`: order, resume, cache, bad input."""

from __future__ import annotations

import gc
import io
import itertools
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from wds import keys, make_samples, shard_bytes, write_shards

import ckptd

SHARDS, PER, BATCH = 7, 20, 8


@pytest.fixture
def data(tmp_path):
    """7 shards of 20 samples in a folder of the test's own (the cache is keyed by path)."""
    return tmp_path / "data", write_shards(tmp_path / "data", SHARDS, PER)


@pytest.fixture
def dc(dataset_daemon):
    with dataset_daemon.client() as c:
        yield c


def read(c: ckptd.Client, source, **kw) -> list[list[dict]]:
    kw.setdefault("batch_size", BATCH)
    with c.dataset(ckptd.DatasetSpec(source, **kw)) as ds:
        return list(ds)


def test_samples_carry_every_field_of_the_shards(dc, data):
    folder, want = data
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH, shuffle_window=1)) as ds:
        assert ds.shards == SHARDS
        batches = list(ds)
        assert ds.closed  # the epoch ended: the session is gone from the daemon
        assert ds.position == SHARDS * PER
    assert all(len(b) == BATCH for b in batches[:-1])
    assert 0 < len(batches[-1]) <= BATCH
    got = {s["__key__"]: s for b in batches for s in b}
    assert len(got) == len(want)
    for key, fields in want.items():
        sample = got[key]
        assert sample.keys() == {"__key__", *fields}
        for ext, value in fields.items():
            assert type(sample[ext]) is bytes
            assert sample[ext] == value
    # shuffle_window=1 keeps each shard's samples in order
    order = keys(batches)
    assert order[:PER] == sorted(order[:PER])


def test_shuffle_block_mixes_shards_exactly_once(dc, tmp_path):
    """shuffle_block: every sample once, a function of the spec, resumable, shards mixed.

    With shards of 60 samples, a window of 20 gives neighbours from one
    shard most of the time; blocks of 4 shards about a quarter of it.
    """
    folder = tmp_path / "blocks"
    want = write_shards(folder, 8, 60)
    spec = {"batch_size": 5, "seed": 2, "even": "off", "shuffle_block": 4}
    per_rank = [keys(read(dc, folder, rank=r, world_size=2, **spec)) for r in range(2)]
    flat = [k for ks in per_rank for k in ks]
    assert len(flat) == len(set(flat)) == len(want)
    assert keys(read(dc, folder, rank=0, world_size=2, **spec)) == per_rank[0]

    def same_shard(order: list[str]) -> float:
        pairs = list(itertools.pairwise(order))
        return sum(a.split("/")[0] == b.split("/")[0] for a, b in pairs) / len(pairs)

    window = keys(read(dc, folder, rank=0, world_size=2, seed=2, even="off", shuffle_window=20))
    assert same_shard(per_rank[0]) < 0.35
    assert same_shard(window) > 0.5

    with dc.dataset(ckptd.DatasetSpec(folder, rank=0, world_size=2, **spec)) as ds:
        first = [next(ds) for _ in range(7)]
        state = ds.state()
    assert state["shuffle_block"] == 4 and state["start"] == 35
    assert keys(first) + keys(read(dc, **{**state, "source": folder})) == per_rank[0]


def test_every_sample_exactly_once_across_ranks(dc, data):
    folder, want = data
    for world in (1, 2, 3, 8):  # 8 ranks > 7 shards: one rank gets none
        per_rank = [
            keys(read(dc, folder, rank=r, world_size=world, seed=5, even="off"))
            for r in range(world)
        ]
        flat = [k for ks in per_rank for k in ks]
        assert len(flat) == len(set(flat)) == len(want), world
        assert set(flat) == set(want)
        if world == 8:
            assert sorted(len(ks) for ks in per_rank)[0] == 0


def test_order_is_a_function_of_seed_and_epoch(dc, data):
    folder, _ = data

    def order(seed: int, epoch: int, rank: int = 0) -> list[str]:
        return keys(read(dc, folder, seed=seed, epoch=epoch, rank=rank, world_size=2))

    a = order(1, 0)
    assert order(1, 0) == a  # same seed, same epoch: same order
    assert order(1, 1) != a  # another epoch: another order
    assert order(2, 0) != a  # another seed: another order
    assert set(order(1, 1)) | set(order(1, 1, rank=1)) == set(a) | set(order(1, 0, rank=1))


def test_resume_at_k_replays_exactly_the_tail(dc, data):
    folder, _ = data
    kw = {"seed": 3, "epoch": 2, "rank": 1, "world_size": 2}
    whole = keys(read(dc, folder, **kw))
    for k in (0, 1, BATCH, 13, len(whole) - 1, len(whole)):
        assert keys(read(dc, folder, start=k, **kw)) == whole[k:], k
    # a start past the end is an empty epoch, not an error
    assert read(dc, folder, start=len(whole) + 5, **kw) == []
    # another batch size cuts the same sequence differently
    assert keys(read(dc, folder, batch_size=5, start=7, **kw)) == whole[7:]


def test_state_resumes_after_the_last_batch(dc, data):
    folder, _ = data
    whole = keys(read(dc, folder, seed=9))
    seen = []
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH, seed=9)) as ds:
        for i, batch in enumerate(ds):
            seen += [s["__key__"] for s in batch]
            if i == 2:
                break
        state = ds.state()
    assert state["start"] == 3 * BATCH == len(seen)
    state = json.loads(json.dumps(state))  # what a checkpoint's metadata would hold
    with dc.dataset(ckptd.DatasetSpec(**state)) as ds:
        rest = keys(list(ds))
    assert seen + rest == whole


def test_second_epoch_of_a_dataset_that_fits_comes_from_the_cache(dc, data):
    folder, _ = data
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH, epoch=0)) as ds:
        list(ds)
        first = ds.stats()
    assert (first.cache_misses, first.cache_hits) == (SHARDS, 0)
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH, epoch=1)) as ds:
        list(ds)
        second = ds.stats()
    assert (second.cache_misses, second.cache_hits) == (0, SHARDS)
    assert second.wait_storage == 0.0
    assert second.batches == -(-SHARDS * PER // BATCH)
    assert second.samples == SHARDS * PER


def test_dataset_larger_than_the_cache_keeps_part_of_it(make_daemon, tmp_path):
    """A budget of about half the dataset: epoch 2 hits some shards and does not thrash."""
    folder = tmp_path / "big"
    write_shards(folder, 12, 4, size=64 << 10)  # 12 shards of ~260 KiB
    d = make_daemon("--cache-bytes", "1600KiB", "--slot-bytes", "1MiB", "--ring-slots", "2")
    rates = []
    with d.client() as c:
        for epoch in range(3):
            with c.dataset(ckptd.DatasetSpec(folder, batch_size=4, epoch=epoch)) as ds:
                assert len(keys(list(ds))) == 48
                st = ds.stats()
            rates.append(st.cache_hits / (st.cache_hits + st.cache_misses))
    assert rates[0] == 0.0
    print("hit rate per epoch", rates)
    assert 0 < rates[2] < 1, rates


def test_stats_say_where_the_wait_went(dc, data):
    folder, _ = data
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH)) as ds:
        assert ds.stats().batches == 0
        list(ds)
        st = ds.stats()
    for cause in (st.wait_storage, st.wait_cache, st.wait_ring, st.wait_work):
        assert cause >= 0.0
    assert st.wait == pytest.approx(st.wait_storage + st.wait_cache + st.wait_ring + st.wait_work)
    assert 0 < st.client_wait <= st.elapsed
    assert 0 < st.stall_fraction <= 1
    d = st.as_dict()
    assert {"wait_storage", "cache_hits", "corrupt_skipped", "stall_fraction"} <= d.keys()
    json.dumps(d)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_zero_copy_fields_are_views_released_with_the_next_batch(dc, data, prefetch):
    folder, want = data
    with dc.dataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), copy=False, prefetch=prefetch
    ) as ds:
        first = next(ds)
        view = first[0]["txt"]
        assert isinstance(view, memoryview)
        assert view.readonly
        assert bytes(view) == want[first[0]["__key__"]]["txt"]
        kept = bytes(first[1]["txt"])
        second = next(ds)
        with pytest.raises(ValueError, match="released"):
            bytes(view)
        assert kept == want[first[1]["__key__"]]["txt"]
        last = second[0]["cls"]
        assert bytes(last) == want[second[0]["__key__"]]["cls"]
    with pytest.raises(ValueError, match="released"):
        bytes(last)  # closing releases the last batch too


@pytest.mark.parametrize("copy", [True, False])
def test_prefetching_changes_nothing_but_the_timing(dc, data, copy):
    folder, want = data
    base = None
    for prefetch in (0, 1, 3):
        seen = []
        with dc.dataset(
            ckptd.DatasetSpec(folder, batch_size=BATCH, seed=2), copy=copy, prefetch=prefetch
        ) as ds:
            for b in ds:
                for s in b:
                    assert bytes(s["txt"]) == want[s["__key__"]]["txt"]
                    seen.append(s["__key__"])
        base = base or seen
        assert seen == base, prefetch
    with pytest.raises(ValueError, match="prefetch"):
        dc.dataset(ckptd.DatasetSpec(folder, batch_size=BATCH), prefetch=-1)


def test_zero_copy_with_few_ring_slots(make_daemon, data):
    """copy=False holds a slot per batch fetched ahead; two slots still make progress."""
    folder, want = data
    d = make_daemon("--slot-bytes", "64KiB", "--ring-slots", "2")
    with d.client() as c:
        for prefetch in (0, 1):
            with c.dataset(
                ckptd.DatasetSpec(folder, batch_size=BATCH), copy=False, prefetch=prefetch
            ) as ds:
                assert len(keys(list(ds))) == len(want)


def test_a_sample_larger_than_a_slot_is_delivered(dc, tmp_path):
    folder = tmp_path / "large"
    folder.mkdir()
    big = os.urandom(1 << 20)  # the fixture's slots are 256 KiB
    (folder / "a.tar").write_bytes(shard_bytes({"big/0": {"bin": big, "cls": b"1"}}))
    (batch,) = read(dc, folder, batch_size=4)
    assert batch[0]["bin"] == big


def test_raw_objects_are_one_sample_each(dc, tmp_path):
    folder = tmp_path / "raw"
    (folder / "sub").mkdir(parents=True)
    files = {"a.jpg": b"A" * 10, "b": b"B" * 3, "sub/c.seg.png": b"C" * 7}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    got = {s["__key__"]: s for b in read(dc, folder, format="raw", batch_size=2) for s in b}
    assert got == {
        "a": {"__key__": "a", "jpg": files["a.jpg"]},
        "b": {"__key__": "b", "bin": files["b"]},
        "sub/c": {"__key__": "sub/c", "seg.png": files["sub/c.seg.png"]},
    }


def test_relative_source_is_resolved_by_the_client(dc, data, monkeypatch):
    folder, want = data
    monkeypatch.chdir(folder.parent)
    assert len(keys(read(dc, "data"))) == len(want)


# ---- corrupt shards -------------------------------------------------------------


def corrupt_folder(tmp_path, how: str):
    """4 shards of 10; train-002.tar cut in its middle or garbage. Returns all samples."""
    folder = tmp_path / how
    want = write_shards(folder, 4, 10)
    bad = folder / "train-002.tar"
    raw = bad.read_bytes()
    if how == "truncated":
        bad.write_bytes(raw[: len(raw) // 2 + 100])
    else:
        bad.write_bytes(b"this is not a tar file at all" * 40)
    return folder, want


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_corrupt_shard_is_an_error_naming_it(dc, tmp_path, how):
    folder, _ = corrupt_folder(tmp_path, how)
    ds = dc.dataset(ckptd.DatasetSpec(folder, batch_size=4))
    with pytest.raises(ckptd.CorruptShardError) as e:
        list(ds)
    assert "train-002.tar" in str(e.value)
    assert e.value.shard is not None and e.value.shard.endswith("train-002.tar")
    assert "skip_corrupt" in str(e.value)
    assert isinstance(e.value, ckptd.DataLossError)
    assert ds.closed
    assert list(ds) == []  # the failed session is over, it does not hang


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_skip_corrupt_skips_and_counts_the_shard(dc, tmp_path, how):
    """The samples before the damage are delivered; the rest of the shard is skipped."""
    folder, want = corrupt_folder(tmp_path, how)
    with dc.dataset(ckptd.DatasetSpec(folder, batch_size=4, skip_corrupt=True)) as ds:
        got = {s["__key__"]: s for b in ds for s in b}
        st = ds.stats()
    assert st.corrupt_skipped == 1
    bad = sorted(k for k in got if k.startswith("s002/"))
    assert set(got) - set(bad) == {k for k in want if not k.startswith("s002/")}
    assert bad == [f"s002/{i:04d}" for i in range(len(bad))]  # a prefix of the shard
    assert 0 < len(bad) < 10 if how == "truncated" else not bad
    for key, sample in got.items():
        assert sample["txt"] == want[key]["txt"]


def test_truncated_exactly_at_a_member_boundary_is_caught(dc, tmp_path):
    """tarfile (and archive/tar) accept a tar cut after a member; ckptd must not."""
    folder = tmp_path / "cut"
    folder.mkdir()
    raw = shard_bytes(make_samples(0, 6))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        members = tf.getmembers()
    cut = members[4].offset  # the header of the fifth member
    (folder / "cut.tar").write_bytes(raw[:cut])
    with pytest.raises(ckptd.CorruptShardError, match=r"cut\.tar"):
        read(dc, folder)


def test_names_that_are_not_utf8_are_refused_not_leaked(make_daemon, tmp_path):
    """A key or field name that is not UTF-8 cannot travel: refused, and the ring stays whole."""
    folder = tmp_path / "names"
    folder.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", encoding="utf-8", errors="surrogateescape") as tf:
        for i in range(12):  # every other sample has a bad key or a bad field name
            key = f"ok/{i:02d}" if i % 2 else f"bad\udcff/{i:02d}"
            ext = "txt" if i % 4 != 1 else "j\udcfeg"
            for name, data in ((f"{key}.{ext}", b"x" * 10), (f"{key}.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    (folder / "a.tar").write_bytes(buf.getvalue())
    d = make_daemon("--ring-slots", "2", "--slot-bytes", "64KiB")
    with d.client(timeout=30) as c:
        for _ in range(4):  # more failures than ring slots: none leaks one
            with pytest.raises(ckptd.CorruptShardError, match=r"a\.tar: member .*not UTF-8") as e:
                read(c, folder, batch_size=1, shuffle_window=1)
            assert e.value.shard.endswith("a.tar")
        with c.dataset(
            ckptd.DatasetSpec(folder, batch_size=1, shuffle_window=1, skip_corrupt=True)
        ) as ds:
            got = keys(list(ds))
            assert ds.stats().corrupt_skipped == 9
        assert got == ["ok/03", "ok/07", "ok/11"]


# ---- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be positive"),
        ({"batch_size": -3}, "batch_size must be positive"),
        ({"rank": 2, "world_size": 2}, r"rank 2 out of range \[0, world_size 2\)"),
        ({"rank": -1}, "rank -1 out of range"),
        ({"world_size": 0}, "world_size must be positive"),
        ({"epoch": -1}, "must not be negative"),
        ({"start": -1}, "must not be negative"),
        ({"shuffle_window": -1}, "shuffle window must not be negative"),
        ({"shuffle_block": 65537}, "shuffle block must be 0 .off. to 65536 shards"),
        ({"format": "lance"}, 'unknown format "lance"'),
        ({"batch_size": 1 << 40}, "batch_size .* out of range"),
        ({"seed": -1}, "seed -1 is out of range"),
    ],
)
def test_bad_arguments_are_invalid_argument(dc, data, kwargs, match):
    folder, _ = data
    kw = {"batch_size": 4, **kwargs}
    with pytest.raises(ckptd.InvalidArgumentError, match=match) as e:
        dc.dataset(ckptd.DatasetSpec(folder, **kw))
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": "4"}, "batch_size must be an int"),
        ({"batch_size": 4.0}, "batch_size must be an int"),
        ({"rank": True}, "rank must be an int"),
        ({"format": None}, "format must be a str"),
        ({"skip_corrupt": 1}, "skip_corrupt must be a bool"),
    ],
)
def test_bad_types_are_type_errors(dc, data, kwargs, match):
    folder, _ = data
    with pytest.raises(TypeError, match=match):
        dc.dataset(ckptd.DatasetSpec(folder, **{"batch_size": 4, **kwargs}))


def test_sources_without_samples_are_invalid_argument(dc, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no shards here")
    with pytest.raises(ckptd.InvalidArgumentError, match=r"no \.tar shards"):
        dc.dataset(ckptd.DatasetSpec(empty, batch_size=4))
    (tmp_path / "raw-empty").mkdir()
    with pytest.raises(ckptd.InvalidArgumentError, match="no objects"):
        dc.dataset(ckptd.DatasetSpec(tmp_path / "raw-empty", format="raw", batch_size=4))
    with pytest.raises(ckptd.InvalidArgumentError, match="no such folder"):
        dc.dataset(ckptd.DatasetSpec(tmp_path / "missing", batch_size=4))
    assert not (tmp_path / "missing").exists(), "a bad source must change nothing"
    with pytest.raises(ckptd.InvalidArgumentError, match="empty"):
        dc.dataset(ckptd.DatasetSpec("", batch_size=4))
    with pytest.raises(ckptd.InvalidArgumentError, match='unsupported scheme "http"'):
        dc.dataset(ckptd.DatasetSpec("http://example.com/data/", batch_size=4))


def test_the_client_works_after_errors(dc, data):
    folder, want = data
    with pytest.raises(ckptd.InvalidArgumentError):
        dc.dataset(ckptd.DatasetSpec(folder, batch_size=0))
    assert len(keys(read(dc, folder))) == len(want)


# ---- which sources may be read ----------------------------------------------------


def test_only_the_sources_the_daemon_allows_are_read(make_daemon, tmp_path):
    """--dataset-allow (the fixtures allow the temporary folder): by real path, nothing else."""
    want = write_shards(tmp_path / "data", 2, 3)
    outside = Path("/dev/shm") / f"ckptd-pytest-outside-{os.getpid()}"  # not beneath any entry
    try:
        write_shards(outside, 1, 3)
        (tmp_path / "link").symlink_to(outside)
        dotdot = str(tmp_path) + "/.." * len(tmp_path.parts) + str(outside)
        with make_daemon().client() as c:
            assert len(keys(read(c, tmp_path / "data"))) == len(want)
            for source in (outside, dotdot, tmp_path / "link", "s3://other/shards"):
                with pytest.raises(ckptd.CkptdError, match="not beneath any source") as e:
                    c.dataset(ckptd.DatasetSpec(source, batch_size=4))
                assert e.value.code == "PERMISSION_DENIED", source
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    d = make_daemon("--dataset-allow", "/dev/shm")  # its arena is beneath: still never a source
    with d.client() as c, pytest.raises(ckptd.CkptdError, match="arena folder") as e:
        c.dataset(ckptd.DatasetSpec(d.arena_dir, batch_size=4))
    assert e.value.code == "PERMISSION_DENIED"


# ---- sessions are freed -----------------------------------------------------------


def test_sessions_are_freed_on_end_break_close_and_gc(make_daemon, data):
    """A datasets' share that holds two rings: a leaked session would fail the third open."""
    folder, want = data
    d = make_daemon(
        "--slot-bytes", "1MiB", "--ring-slots", "3", "--dataset-arena-bytes", "7MiB", staging="8MiB"
    )  # fmt: skip
    with d.client(timeout=30) as c:
        for _ in range(3):
            assert len(keys(list(c.dataset(ckptd.DatasetSpec(folder, batch_size=4))))) == len(
                want
            )  # exhausted
        for _ in range(3):
            for _ in c.dataset(
                ckptd.DatasetSpec(folder, batch_size=4)
            ):  # break: the iterator is collected
                break
        for _ in range(3):
            with c.dataset(ckptd.DatasetSpec(folder, batch_size=4)) as ds:
                next(ds)
        for _ in range(3):
            ds = c.dataset(ckptd.DatasetSpec(folder, batch_size=4))
            next(ds)
            del ds
            gc.collect()
        for _ in range(3):
            c.dataset(ckptd.DatasetSpec(folder, batch_size=4)).close()
        open_now = [
            c.dataset(ckptd.DatasetSpec(folder, batch_size=4)),
            c.dataset(ckptd.DatasetSpec(folder, batch_size=4)),
        ]
        # The share really holds only two rings. (The daemon waits for room
        # as long as the call allows rather than failing at once.)
        with (
            d.client(timeout=2) as short,
            pytest.raises((ckptd.ResourceExhaustedError, ckptd.TimeoutError)),
        ):
            short.dataset(ckptd.DatasetSpec(folder, batch_size=4))
        del open_now
    with d.client() as c:
        ds = c.dataset(ckptd.DatasetSpec(folder, batch_size=4))
        next(ds)
    assert ds.closed  # closing the client closed its datasets
    with d.client() as c:
        assert len(keys(read(c, folder))) == len(want)
        assert len(keys(read(c, folder))) == len(want)


def test_a_closed_client_ends_iteration_with_client_closed(dataset_daemon, data):
    folder, _ = data
    c = dataset_daemon.client()
    ds = c.dataset(ckptd.DatasetSpec(folder, batch_size=4))
    next(ds)
    c.close()
    assert list(ds) == []
    with pytest.raises(ckptd.ClientClosedError):
        c.dataset(ckptd.DatasetSpec(folder, batch_size=4))


def test_copies_hand_the_gil_over_only_while_the_trainer_has_a_batch(monkeypatch):
    """copy=True copies yield the GIL every few samples while the trainer has a batch to take.

    Then a trainer waking from its step never waits for a copy to end; a
    batch the trainer is waiting for is copied in one go.
    """
    from types import SimpleNamespace

    from ckptd import _dataset
    from ckptd.v1 import ckptd_pb2 as pb

    n, size = 40, 8
    region = bytes(range(256)) * 2
    samples = [
        pb.Sample(key=f"k{i}", fields=[pb.SampleField(name="bin", offset=i * size, length=size)])
        for i in range(n)
    ]
    arena = SimpleNamespace(mapping=region)
    naps: list[float] = []
    monkeypatch.setattr(_dataset.time, "sleep", naps.append)
    for ahead, want in ((False, 0), (True, n // _dataset._YIELD_EVERY)):
        naps.clear()
        out = _dataset._copied(samples, arena, 0, len(region), "test", lambda a=ahead: a)
        assert len(naps) == want
        assert [s["bin"] for s in out] == [region[i * size : (i + 1) * size] for i in range(n)]
        assert all(type(s["bin"]) is bytes for s in out)
