"""ckptd.dcp: torch.distributed.checkpoint through a real daemon, real processes.

Four gloo processes on the CPU save an FSDP2-sharded model and its AdamW
state with dcp.save and dcp.async_save through ckptd.dcp.Writer; separate
runs of 4, 2 and 1 processes load both steps through ckptd.dcp.Reader
(resharding) and compare the gathered state bit for bit.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import launch as run_workers
from slow import scaled
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import ckptd
import ckptd.dcp
from ckptd import _sharding

WORKER = Path(__file__).with_name("dcp_worker.py")
SAVED_WORLD = 4


def launch(mode: str, world: int, socket: str, job: str, out: Path) -> None:
    """Run world workers of this test, as torchrun would, and wait for them."""
    run_workers(WORKER, mode, world, socket, job, out)


@pytest.fixture(scope="module")
def saved(daemon, tmp_path_factory):
    """A job whose steps 10 (dcp.save) and 11 (dcp.async_save) four ranks saved."""
    out = tmp_path_factory.mktemp("dcp")
    job = "dcp-fsdp2"
    launch("save", SAVED_WORLD, daemon.socket, job, out)
    return job, out


def test_the_saved_steps_are_committed_with_world_size_4(saved, daemon, ckptd_bin):
    job, _ = saved
    listed = subprocess.run(
        [str(ckptd_bin), "list", "--storage", str(daemon.storage), "--job", job, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    steps = {s["step"]: s for s in json.loads(listed.stdout)}
    assert set(steps) == {10, 11}, listed.stdout
    assert all(s["world_size"] == SAVED_WORLD for s in steps.values()), listed.stdout


@pytest.mark.parametrize("world", [4, 2, 1])
def test_load_reshards_bit_for_bit(saved, daemon, world):
    job, out = saved
    launch("load", world, daemon.socket, job, out)
    report = json.loads((out / f"load_{world}.json").read_text())
    assert report["10"] == {"step": 10, "diff": []}
    assert report["latest"] == {"step": 11, "diff": []}


@pytest.mark.parametrize("step", [10, 11])
def test_each_rank_shard_describes_its_pieces(saved, daemon, step):
    """ckptd.sharding names every tensor piece, and the pieces tile each tensor once.

    Step 11 (async_save) stages without collectives: each rank stores its
    own copy of the plain (replicated) tensors, which only rank 0 describes.
    """
    job, _ = saved
    covered: dict[tuple[str, str], np.ndarray] = {}
    with daemon.client() as c:
        for rank in range(SAVED_WORLD):
            shard = c.load(step, rank=rank, job=job, nested=False)
            described = _sharding.decode(shard[_sharding.TENSOR])
            names = set(shard) - {_sharding.TENSOR}
            tensors = {n for n in names if not n.startswith(f"{ckptd.dcp.BYTES}:")}
            if step == 10 or rank == 0:
                assert set(described) == tensors, rank
            else:
                assert set(described) <= tensors, rank
            assert ckptd.dcp.METADATA not in shard  # small: the save's metadata
            md = pickle.loads(shard.metadata) if rank == 0 else None
            assert isinstance(md, Metadata) if rank == 0 else shard.metadata == b""
            for name, p in described.items():
                assert name == f"{p.group}:{p.fqn}"  # one piece of each per rank here
                shape = shard[name].shape
                cover = covered.setdefault((p.group, p.fqn), np.zeros(p.global_shape, np.int64))
                box = tuple(slice(o, o + n) for o, n in zip(p.offsets, shape, strict=True))
                assert all(
                    o + n <= g for o, n, g in zip(p.offsets, shape, p.global_shape, strict=True)
                ), name
                cover[box] += 1
    assert covered[("model", "0.weight")].shape == (16, 8)
    assert ("optimizer", "state.4.bias.exp_avg_sq") in covered
    assert ("optimizer", "state.4.bias.step") in covered  # replicated: described by one rank
    for key, cover in covered.items():
        assert (cover == 1).all(), key


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_metadata_too_large_for_a_request_is_a_tensor(client, job, monkeypatch, how):
    """Metadata over MAX_METADATA goes in rank 0's dcp.metadata tensor, and loads the same."""
    monkeypatch.setattr(ckptd.dcp._limits, "MAX_METADATA", 16)
    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": {"n": 7}}
    writer = ckptd.dcp.Writer(client, 3, job=job)
    if how == "save":
        dcp.save(sd, storage_writer=writer)
    else:
        fut = dcp.async_save(sd, storage_writer=writer)
        sd["model"]["w"].add_(100)  # the staged copy is in the daemon
        fut.result(timeout=scaled(120))
        sd["model"]["w"].sub_(100)
    shard = client.load(3, rank=0, job=job, nested=False)
    assert ckptd.dcp.METADATA in shard and shard.metadata == b""
    got = {"model": {"w": torch.zeros(2, 3)}, "extra": {"n": 0}}
    dcp.load(got, storage_reader=ckptd.dcp.Reader(client, 3, job=job))
    assert torch.equal(got["model"]["w"], sd["model"]["w"]) and got["extra"]["n"] == 7


def test_reader_for_an_unknown_step_says_so(saved, daemon):
    job, _ = saved
    with daemon.client() as c:
        reader = ckptd.dcp.Reader(c, 99, job=job)
        with pytest.raises(ckptd.NotFoundError, match="99"):
            reader.read_metadata()
        # dcp.load reports every rank's failure (one here) in a CheckpointException.
        with pytest.raises(CheckpointException, match=r"step 99 .* is not committed"):
            dcp.load({"x": torch.zeros(1)}, storage_reader=ckptd.dcp.Reader(c, 99, job=job))
        assert ckptd.dcp.Reader(c, "latest", job=job).read_metadata().state_dict_metadata
        with pytest.raises(TypeError):
            ckptd.dcp.Reader(c, "newest", job=job)  # type: ignore[arg-type]


def test_reader_refuses_a_step_not_saved_by_the_writer(client, job):
    client.save(1, {"w": torch.ones(2)}, rank=0, world_size=1, job=job).wait(30)
    with pytest.raises(ckptd.CkptdError, match=r"not saved by ckptd\.dcp\.Writer"):
        ckptd.dcp.Reader(client, 1, job=job).read_metadata()


# ---- the step from DCP's checkpoint_id (issue 24) ----------------------------


@pytest.mark.parametrize(
    ("cid", "job", "step"),
    [
        ("ckptd://run-1/7", "run-1", 7),
        ("ckptd://run-1/step-7/", "run-1", 7),
        ("ckptd:///7", None, 7),
        ("ckptd:///checkpoint-0007", None, 7),
        ("/out/run-1/step-1000", None, 1000),
        ("/out/run-1/step_1000/", None, 1000),
        ("outputs/checkpoint/step1000", None, 1000),
        ("/out/checkpoint-1000", None, 1000),
        ("/out/ckpt-1000.pt", None, 1000),
        ("/megatron/iter_0001000", None, 1000),
        ("/ds/global_step1000", None, 1000),
        ("/lightning/checkpoints/epoch=3-step=1000.ckpt", None, 1000),
        ("/lightning/checkpoints/epoch=3-step=1000-v1.ckpt", None, 1000),
        ("/out/1000", None, 1000),
        (Path("/out/step-12"), None, 12),
        ("s3://bucket/run/step-5", None, 5),
    ],
)
def test_checkpoint_ids_name_the_step(cid, job, step):
    assert ckptd.dcp.parse_checkpoint_id(cid) == ckptd.dcp.CheckpointId(job, step)


@pytest.mark.parametrize(
    "cid",
    [
        "/out/final", "/out/step-", "/out/epoch=3", "/out/epoch-3-step-10", "/out/step-1.5",
        "/out/step=1-step=2",
        "ckptd://run-1", "ckptd://run-1/", "ckptd://run-1/final", "ckptd://a/b/step-3",
        "ckptd:///latest", "", "/",
    ],
)  # fmt: skip
def test_checkpoint_ids_without_a_step_are_refused_naming_the_forms(cid):
    with pytest.raises(ckptd.InvalidArgumentError, match=r"names no step.*ckptd://<job>/<step>"):
        ckptd.dcp.parse_checkpoint_id(cid)


def test_latest_only_for_a_reader():
    assert ckptd.dcp.parse_checkpoint_id("ckptd://j/latest", latest=True).step == "latest"
    assert ckptd.dcp.Writer.validate_checkpoint_id("ckptd://j/step-3")
    assert ckptd.dcp.Reader.validate_checkpoint_id(Path("ckptd:/j/3")) is False  # a Path mangles //
    assert not ckptd.dcp.Writer.validate_checkpoint_id("/out/step-3")


def test_writer_and_reader_take_the_step_from_the_checkpoint_id(client, job, tmp_path):
    sd = {"model": {"w": torch.arange(6.0)}, "extra": {"n": 3}}
    writer = ckptd.dcp.Writer(client, job=job)
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "ckpt" / "step-5")
    sd["model"]["w"].add_(1)
    fut = dcp.async_save(
        sd, storage_writer=writer, checkpoint_id=f"ckptd://{job}/checkpoint-6"
    )  # the same Writer, another step: async_save stages before DCP resets the writer
    sd["model"]["w"].add_(100)  # staged already
    fut.result(timeout=scaled(120))
    assert [s.step for s in client.steps(job)] == [5, 6]
    reader = ckptd.dcp.Reader(client)
    for cid, want in (
        (f"ckptd://{job}/5", 0.0),
        (f"ckptd://{job}/latest", 1.0),
        (str(tmp_path / "epoch=0-step=6.ckpt"), 1.0),
    ):
        got = {"model": {"w": torch.zeros(6)}, "extra": {"n": 0}}
        if "ckptd://" in cid:
            dcp.load(got, storage_reader=reader, checkpoint_id=cid)
        else:
            dcp.load(got, storage_reader=ckptd.dcp.Reader(client, job=job), checkpoint_id=cid)
        assert torch.equal(got["model"]["w"], torch.arange(6.0) + want), cid
        assert got["extra"]["n"] == 3
    assert reader.step == 6


def test_a_step_given_both_ways_must_agree(client, job, tmp_path):
    sd = {"model": {"w": torch.ones(2)}}
    with pytest.raises(ckptd.InvalidArgumentError, match=r"names step 10, but .* saves step 1"):
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job),
                 checkpoint_id=tmp_path / "step-10")  # fmt: skip
    with pytest.raises(ckptd.InvalidArgumentError, match=r"names step 10, but .* saves step 1"):
        dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job),
                       checkpoint_id=tmp_path / "step-10")  # fmt: skip
    with pytest.raises(ckptd.InvalidArgumentError, match=r"names job 'other', but .* job"):
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, job=job),
                 checkpoint_id="ckptd://other/3")  # fmt: skip
    with pytest.raises(ckptd.InvalidArgumentError, match="names no step"):
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, job=job),
                 checkpoint_id=tmp_path / "final")  # fmt: skip
    # No step at all: async_save says so at once; dcp.save as the first thing of its
    # local planning, which DCP reports in a CheckpointException.
    with pytest.raises(ckptd.InvalidArgumentError, match="has no step"):
        dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, job=job))
    with pytest.raises(CheckpointException, match="has no step"):
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, job=job))
    with pytest.raises(ckptd.InvalidArgumentError, match="names no step"):  # beside a step too
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 3, job=job), checkpoint_id=tmp_path)
    # The same step both ways is fine.
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 2, job=job),
             checkpoint_id=tmp_path / "step-2")  # fmt: skip
    assert [s.step for s in client.steps(job)] == [2]  # nothing of the refused ones
    with pytest.raises(ckptd.InvalidArgumentError, match=r"names step 3, but .* reads step 2"):
        dcp.load(sd, storage_reader=ckptd.dcp.Reader(client, 2, job=job),
                 checkpoint_id=f"ckptd://{job}/3")  # fmt: skip


def test_an_earlier_saves_checkpoint_id_is_not_reused(client, job, tmp_path):
    sd = {"model": {"w": torch.ones(2)}}
    writer = ckptd.dcp.Writer(client, job=job)
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "step-1")
    with pytest.raises(CheckpointException, match="has no step"):
        dcp.save(sd, storage_writer=writer)  # not step 1 again
    reader = ckptd.dcp.Reader(client, job=job)
    dcp.load(sd, storage_reader=reader, checkpoint_id=tmp_path / "step-1")
    with pytest.raises(CheckpointException, match="has no step"):
        dcp.load(sd, storage_reader=reader)


def test_the_checkpoint_process_is_refused_before_anything_is_staged(client, job):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = {"model": {"w": torch.ones(2)}}
    with pytest.raises(ckptd.CkptdError, match=r"PROCESS.*Use the default AsyncCheckpointerType"):
        dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    assert client.steps(job) == []
    # Nothing holds step 1: a staged rank 0 would make this SAVE_IN_PROGRESS.
    client.save(1, {"w": torch.ones(2)}, rank=0, world_size=1, job=job).wait(scaled(60))


@pytest.fixture
def default_socket(daemon, monkeypatch):
    """$CKPTD_SOCKET names the test daemon; ckptd.dcp's own client is made afresh."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    monkeypatch.setattr(ckptd.dcp, "_default", None)
    yield
    if ckptd.dcp._default is not None:
        ckptd.dcp._default.close()


def test_a_ckptd_checkpoint_id_alone_finds_ckptd(default_socket, client, job, tmp_path):
    """Importing ckptd.dcp lets DCP take a ckptd:// id given alone (torch 2.15 has no registry)."""
    assert ckptd.dcp.FOUND_BY_ID
    sd = {"model": {"w": torch.arange(3.0)}, "extra": {"n": 1}}
    dcp.save(sd, checkpoint_id=f"ckptd://{job}/step-3")
    sd["model"]["w"].add_(1)
    dcp.async_save(sd, checkpoint_id=f"ckptd://{job}/4").result(timeout=scaled(120))
    assert [s.step for s in client.steps(job)] == [3, 4]
    for cid, want in ((f"ckptd://{job}/3", 0.0), (f"ckptd://{job}/latest", 1.0)):
        got = {"model": {"w": torch.zeros(3)}, "extra": {"n": 0}}
        dcp.load(got, checkpoint_id=cid)
        assert torch.equal(got["model"]["w"], torch.arange(3.0) + want) and got["extra"]["n"] == 1
    with pytest.raises(ckptd.InvalidArgumentError, match="names no step"):  # before DCP plans
        dcp.save(sd, checkpoint_id=f"ckptd://{job}/final")
    # Any other id is DCP's as before: a folder for its FileSystemWriter.
    dcp.save(sd, checkpoint_id=tmp_path / "step-5")
    assert (tmp_path / "step-5" / ".metadata").exists()
    assert [s.step for s in client.steps(job)] == [3, 4]


def test_dcps_plan_caching_works_with_the_writer(client, job):
    """DefaultSavePlanner(enable_plan_caching=True): DCP reuses its plans (sync and async)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sd = {"model": {"w": torch.arange(6.0)}, "extra": {"n": 3}}
    for step in (1, 2, 3, 4):
        sd["model"]["w"].add_(1)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        writer = ckptd.dcp.Writer(client, step, job=job)
        if step <= 2:
            dcp.save(sd, storage_writer=writer, planner=planner)
        else:
            dcp.async_save(sd, storage_writer=writer, planner=planner).result(scaled(120))
        assert planner._cached_plans_key == "DefaultSavePlanner"  # the caller's, untouched
    for step in (1, 2, 3, 4):
        got = {"model": {"w": torch.zeros(6)}, "extra": {"n": 0}}
        dcp.load(got, storage_reader=ckptd.dcp.Reader(client, step, job=job))
        assert torch.equal(got["model"]["w"], torch.arange(6.0) + step) and got["extra"]["n"] == 3
