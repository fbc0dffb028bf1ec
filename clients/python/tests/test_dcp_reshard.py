"""A resharding ckptd.dcp load reads from storage only what the loading ranks need.

Four gloo processes save a sharded model and its AdamW state through
ckptd.dcp.Writer; separate runs of 2, 1 and 3 processes load it through
ckptd.dcp.Reader from a daemon whose memory holds none of it (no hot
tier), checking every piece bit for bit. The daemon's metrics count the
bytes read from its store (ckptd_backend_read_bytes_total) and the bytes
restored to the ranks (ckptd_restored_bytes_total): the first is at most
1.1x the second. 2 and 1 ranks read whole shards; 3 ranks read parts of
stored tensors (slices). The metadata comes without reading any data of
rank 0's shard.

Chunks are the unit a restore reads and verifies: the daemon's chunk size
is small here (64 KiB) against the state (about 4.5 MiB), as a real
job's 4 MiB chunks are against its shards, so that the one chunk each
small plain value costs is noise.
"""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest
from launch import launch as run_workers
from slow import scaled

import ckptd.dcp

WORKER = Path(__file__).with_name("dcp_reshard_worker.py")
STATE = 3 * 4 * 96 * 1024 * 4  # the worker's tensor bytes, all ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(addr: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=scaled(30)) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"/metrics has no {name}{labels}"
    return float(m.group(1))


def _saved(ckptd_bin, tmp_path_factory, *flags: str):
    """A daemon with /metrics (and flags) and step 1 of job "reshard", saved by 4 ranks."""
    from conftest import Daemon

    addr = f"127.0.0.1:{_free_port()}"
    d = Daemon(ckptd_bin, "--chunk-size", "64KiB", "--metrics-addr", addr, *flags)
    out = tmp_path_factory.mktemp("reshard")
    try:
        run_workers(WORKER, "save", 4, d.socket, "reshard", out)
        yield d, addr, out
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def saved(ckptd_bin, tmp_path_factory):
    """Step 1 saved by 4 ranks through a daemon without a hot tier: loads read storage."""
    yield from _saved(ckptd_bin, tmp_path_factory)


@pytest.mark.parametrize("world", [2, 1, 3])
def test_a_resharding_load_reads_what_it_needs(saved, world):
    d, addr, out = saved
    read = 'ckptd_backend_read_bytes_total{backend="store"}'
    before = (_metric(addr, read), _metric(addr, "ckptd_restored_bytes_total"))
    run_workers(WORKER, "load", world, d.socket, "reshard", out)
    stored = _metric(addr, read) - before[0]
    restored = _metric(addr, "ckptd_restored_bytes_total") - before[1]
    loaded = sum(int((out / f"loaded_{world}_{r}").read_text()) for r in range(world))
    assert loaded == STATE
    # What the ranks received: their pieces, and little else (plain values).
    assert loaded <= restored <= loaded * 1.01 + 4096, (restored, loaded)
    assert stored <= 1.1 * restored, (stored, restored)


def test_small_values_ride_in_the_metadata(saved):
    """The plain values (step counts, the learning rate) ride in the metadata: no restore."""
    d, _, _ = saved
    with d.client() as c:
        md = ckptd.dcp.Reader(c, 1, job="reshard").read_metadata()
    _, inline = md.storage_data[ckptd.dcp.INLINE]
    fqns = {idx.fqn for idx in inline}
    steps = {f"optim.state.layers.{i}.weight.step" for i in range(4)}
    assert fqns == steps | {"optim.param_groups.0.lr"}, fqns
    assert all(len(b) <= ckptd.dcp.INLINE_ITEM for b in inline.values())


@pytest.fixture(scope="module")
def saved_hot(ckptd_bin, tmp_path_factory):
    """As saved, by a daemon with a hot tier: its loads come from memory, in place."""
    yield from _saved(ckptd_bin, tmp_path_factory, "--hot-bytes", "64MiB")


@pytest.mark.parametrize("world", [4, 3])
def test_a_load_from_the_hot_tier_reads_it_in_place(saved_hot, world):
    """Whole shards and slices of them come from the hot copies as they lie, bit for bit."""
    d, addr, out = saved_hot
    read = 'ckptd_backend_read_bytes_total{backend="store"}'
    in_place = "ckptd_restored_in_place_bytes_total"
    before = (_metric(addr, read), _metric(addr, in_place))
    run_workers(WORKER, "load", world, d.socket, "reshard", out)
    loaded = sum(int((out / f"loaded_{world}_{r}").read_text()) for r in range(world))
    assert loaded == STATE  # each worker checked its values
    stored = _metric(addr, read) - before[0]
    assert stored < loaded / 10, stored  # commit records and manifests, no shard data
    assert _metric(addr, in_place) - before[1] >= loaded
