"""ckptd.dcp does what DCP's own FileSystemWriter and FileSystemReader do (issue 24).

Each case saves one state dict both ways, DCP's file system storage and
ckptd.dcp through a real daemon, loads each back and compares the two
loads with each other and with what was saved. The cases follow what
PyTorch's own test/distributed/checkpoint tests ask of FileSystemWriter
(theirs mostly need GPUs and nccl, or ShardedTensor): tensors only,
non-tensor values (lists, strings, BytesIO, nested containers), empty and
0-dim tensors, thousands of small tensors, loading into other dtypes, a
subset of the keys, a key the checkpoint lacks, DCP's load without a
target, async_save with the state changed at once, and, over two gloo
processes (dcp_parity_worker.py), DTensors loaded with other shard plans.
Where ckptd differs on purpose (a committed step is never overwritten),
the test says so.
"""

from __future__ import annotations

import copy
import io
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_worker import diff as same
from launch import launch
from slow import scaled
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import ckptd
import ckptd.dcp

WORKER = Path(__file__).with_name("dcp_parity_worker.py")


def sample(seed: int = 0) -> dict[str, Any]:
    """A state dict of what trainers keep, tensors and otherwise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    return {
        "model": {
            "w": w,
            "t": torch.randn(3, 5, generator=g).t(),  # strided
            "half": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(5, generator=g).bfloat16(),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),  # 0-dim
            "int0d": torch.tensor(7, dtype=torch.int32),
            "empty": torch.empty(0),
            "empty2d": torch.empty(3, 0, dtype=torch.int64),
        },
        "optim": {  # as torch.optim's state_dict: int keys, per-parameter dicts
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "name": "g0"}],
        },
        "extra": {
            "int": 7 + seed,
            "float": 0.25,
            "nan": math.nan,
            "str": "h\u00e9llo",
            "none": None,
            "bool": True,
            "bytes": b"\x00\x01\xff",
            "io": io.BytesIO(b"abc%d" % seed),
            "list": [1, "two", 3.0],
            "tuple": (1, (2, "x")),
            "dtype": torch.float16,
            "nested": {
                "a": [torch.arange(3) + seed, {"b": torch.ones(2)}],
                "big": list(range(5000)),
            },
        },
        "many": {f"p{i}": torch.full((3,), float(i + seed)) for i in range(3000)},
    }


def blank(like: Any) -> Any:
    """A target of like's structure: tensors of its shapes zeroed, other values dummies."""
    if isinstance(like, dict):
        return {k: blank(v) for k, v in like.items()}
    if isinstance(like, list):
        return [blank(v) for v in like]
    if isinstance(like, torch.Tensor):
        return torch.zeros_like(like).contiguous()
    if isinstance(like, io.BytesIO):
        return io.BytesIO()
    return None


def both(client: ckptd.Client, job: str, tmp: Path, sd: dict[str, Any], step: int) -> None:
    """Save sd with FileSystemWriter (tmp/step) and ckptd.dcp (step)."""
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp / str(step)))
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, step, job=job))


def load_both(
    client: ckptd.Client, job: str, tmp: Path, target: Any, step: int, **kw: Any
) -> tuple[Any, Any]:
    fs, ours = blank(target), blank(target)
    dcp.load(fs, storage_reader=dcp.FileSystemReader(tmp / str(step)), **kw)
    dcp.load(ours, storage_reader=ckptd.dcp.Reader(client, step, job=job), **kw)
    return fs, ours


def test_everything_a_trainer_keeps_loads_as_from_files(client, job, tmp_path):
    sd = sample()
    both(client, job, tmp_path, sd, 1)
    fs, ours = load_both(client, job, tmp_path, sd, 1)
    assert same(ours, fs) == []
    assert same(ours, sd) == []


def test_dcp_loads_without_a_target_as_from_files(client, job, tmp_path):
    """DCP's _load_state_dict_from_keys builds the state from the metadata alone."""
    sd = {"model": sample()["model"], "extra": {"n": 3, "io": io.BytesIO(b"z")}}
    both(client, job, tmp_path, sd, 1)
    fs = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(tmp_path / "1"))
    ours = _load_state_dict_from_keys(storage_reader=ckptd.dcp.Reader(client, 1, job=job))
    assert same(ours, fs) == []
    some = _load_state_dict_from_keys(
        {"model.w"}, storage_reader=ckptd.dcp.Reader(client, 1, job=job)
    )
    assert same(some, {"model": {"w": sd["model"]["w"]}}) == []


def test_other_dtypes_a_subset_and_a_missing_key_as_with_files(client, job, tmp_path):
    sd = {"model": {"w": torch.randn(4, 3), "b": torch.arange(5)}, "extra": {"n": 1}}
    both(client, job, tmp_path, sd, 1)
    # Into other dtypes: DCP converts, whichever storage.
    target = {"model": {"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(5)}}
    fs, ours = load_both(client, job, tmp_path, target, 1)
    assert same(ours, fs) == [] and ours["model"]["w"].dtype == torch.float64
    assert torch.equal(ours["model"]["w"], sd["model"]["w"].double())
    # A subset of the keys.
    fs, ours = load_both(client, job, tmp_path, {"model": {"b": sd["model"]["b"]}}, 1)
    assert same(ours, fs) == [] and torch.equal(ours["model"]["b"], sd["model"]["b"])
    # A key the checkpoint lacks: refused both ways, unless partial loads are allowed.
    more = {"model": {"w": torch.zeros(4, 3), "x": torch.zeros(1)}}
    for reader in (dcp.FileSystemReader(tmp_path / "1"), ckptd.dcp.Reader(client, 1, job=job)):
        with pytest.raises(
            CheckpointException, match=r"Missing key in checkpoint state_dict: model\.x"
        ):
            dcp.load(blank(more), storage_reader=reader)
    fs, ours = load_both(
        client, job, tmp_path, more, 1, planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    assert same(ours, fs) == [] and not ours["model"]["x"].any()


class Gated(ckptd.dcp.Writer):
    """A Writer whose DCP background save waits (before planning) until the gate opens."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    def storage_meta(self) -> Any:  # DCP's first call of a save, before it plans
        assert self.gate.wait(scaled(120)), "the gate was never opened"
        return super().storage_meta()


def test_async_save_keeps_the_state_at_the_call(client, job, tmp_path):
    """Training on at once, the optimizer's state and the dicts changing, changes no checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": 1}}
    want = copy.deepcopy(sd)
    fut_fs = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "1"))
    fut_fs.result(timeout=scaled(120))
    gated = Gated(client, 1, job=job)
    fut = dcp.async_save(sd, storage_writer=gated)
    for _ in range(3):  # at once: the optimizer steps change the tensors in place
        train()
    sd["extra"]["step"] = 4  # and the trainer's dicts change under the save
    sd["extra"]["new"] = torch.ones(1)
    del sd["optim"]["param_groups"]
    sd["model"]["weight"] = torch.zeros(9)
    gated.gate.set()  # only now may DCP's background save plan
    fut.result(timeout=scaled(120))
    assert not torch.equal(model.weight, want["model"]["weight"])
    for reader in (dcp.FileSystemReader(tmp_path / "1"), ckptd.dcp.Reader(client, 1, job=job)):
        got = blank(want)
        dcp.load(got, storage_reader=reader)
        assert same(got, want) == [], reader


def test_a_committed_step_is_never_overwritten(client, job, tmp_path):
    """DCP's FileSystemWriter overwrites a folder; ckptd refuses, or keeps the step when asked."""
    sd = {"model": {"w": torch.ones(3)}}
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    sd["model"]["w"].fill_(2.0)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))  # overwritten
    switch = r"committed.*if_committed=\"keep\""
    with pytest.raises(CheckpointException, match=switch):  # dcp.save: found in write_data
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job))
    with pytest.raises(ckptd.AlreadyExistsError, match=switch):  # async_save: in stage()
        dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job))
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job, if_committed="keep"))
    kept = dcp.async_save(
        sd, storage_writer=ckptd.dcp.Writer(client, 1, job=job, if_committed="keep")
    )
    kept.result(timeout=scaled(120))
    got = {"model": {"w": torch.zeros(3)}}
    dcp.load(got, storage_reader=ckptd.dcp.Reader(client, 1, job=job))
    assert torch.equal(got["model"]["w"], torch.ones(3))  # the committed step, as it was
    dcp.load(got, storage_reader=dcp.FileSystemReader(tmp_path))
    assert torch.equal(got["model"]["w"], torch.full((3,), 2.0))
    # Nothing of the refused or kept saves is left holding the next step.
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 2, job=job))
    assert [s.step for s in client.steps(job)] == [1, 2]
    with pytest.raises(ckptd.InvalidArgumentError, match="if_committed"):
        ckptd.dcp.Writer(client, 3, if_committed="overwrite")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def two_ranks(daemon, tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp-parity")
    return daemon, out


def test_dtensors_load_with_other_shard_plans_as_from_files(two_ranks):
    daemon, out = two_ranks
    launch(WORKER, "parity", 2, daemon.socket, "dcp-parity", out)
    report = json.loads((out / "parity.json").read_text())
    assert len(report) == 8
    assert report == {k: [] for k in report}


def test_a_repeated_save_of_one_layout_makes_no_plan(two_ranks):
    """DCP's plan caching, on by default: the coordinator plans the first save and a changed one.

    A repeated save's ranks send DCP empty plans and the coordinator reuses
    its global plan and metadata; DCP still gathers and scatters the (empty)
    plans, its collective.
    """
    daemon, out = two_ranks
    launch(WORKER, "plans", 2, daemon.socket, "dcp-plans", out)
    report = json.loads((out / "plans.json").read_text())
    # Steps 1-7: dcp.save on odd steps, async_save on even ones; step 7 another layout.
    assert report["global"] == [1, 0, 0, 0, 0, 0, 1]
    for rank, items in enumerate(report["local_items"]):
        assert items[0] > 0 and items[1:6] == [0] * 5 and items[6] > items[0], (rank, items)
