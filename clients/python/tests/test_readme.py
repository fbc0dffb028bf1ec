"""The READMEs' first examples run as written, against a real daemon.

The code is taken from README.md (its quick start), docs/checkpoints.md
(its first trainer example, under "Saving from a trainer") and
clients/python/README.md (its first example), so the documentation cannot
drift from what works: a model's state saved with ``c.save`` and loaded
with ``c.load`` goes back into the model, a second run resumes from it,
and the dataset lines read shards from a real MinIO.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from s3util import REGION, MinIO, minio_binary
from wds import make_samples, shard_bytes

REPO = Path(__file__).resolve().parents[3]


def first_block(readme: Path, after: str) -> str:
    """The first ```python block of readme after the line `after`."""
    text = readme.read_text()
    start = text.index(after)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {after!r} in {readme}"
    return m.group(1)


def run(code: str, model: torch.nn.Module, where: str, **names: object) -> dict:
    ns = {"model": model, "np": np, "__name__": "readme", **names}
    exec(compile(code, where, "exec"), ns)  # the README's own code, as written
    return ns


@pytest.fixture
def minio(tmp_path):
    binary = minio_binary()
    if binary is None:
        pytest.skip("minio is not installed (run scripts/minio.sh)")
    server = MinIO(binary, tmp_path / "minio")
    yield server
    server.stop()


def dataset_daemon_on(minio, make_daemon, monkeypatch):
    """A daemon allowed to read s3://bucket/train, holding 3 shards."""
    minio.make_bucket("bucket")
    for s in range(3):
        minio.put("bucket", f"train/train-{s:03d}.tar", shard_bytes(make_samples(s, 40)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio.secret_key)
    monkeypatch.setenv("AWS_REGION", REGION)
    d = make_daemon("--s3-endpoint", minio.endpoint, "--dataset-allow", "s3://bucket/train")
    monkeypatch.setenv("CKPTD_SOCKET", d.socket)
    return d


def test_readme_quick_start(minio, make_daemon, monkeypatch):
    """Run twice: the first run trains and saves, the second resumes."""
    code = first_block(REPO / "README.md", "## A trainer's quick start")
    dataset_daemon_on(minio, make_daemon, monkeypatch)

    def train_one_step(model):
        with torch.no_grad():
            model.weight += 1

    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.zero_()  # whole numbers: 3000 steps of +1 are exact
    ns = run(code, model, "README.md", steps=3000, train_one_step=train_one_step)
    assert torch.equal(model.weight, torch.full((4, 8), 3000.0))
    assert isinstance(ns["batch"], list) and ns["batch"][0]["__key__"].startswith("s0")
    ns["c"].close()

    resumed = torch.nn.Linear(8, 4)  # a new process: fresh weights, then the checkpoint's
    ns = run(code, resumed, "README.md", steps=3000, train_one_step=train_one_step)
    assert ns["start"] == 3000
    assert torch.equal(resumed.weight, torch.full((4, 8), 3000.0))
    ns["c"].close()


def test_checkpoints_doc_first_example(minio, make_daemon, monkeypatch):
    code = first_block(REPO / "docs" / "checkpoints.md", "## Saving from a trainer")
    assert "c.load(" in code and "c.dataset(" in code
    dataset_daemon_on(minio, make_daemon, monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ns = run(code, model, "README.md")  # model.load_state_dict(state) failed on numpy arrays
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert ns["state"].step == 9000
    assert isinstance(ns["batch"], list) and ns["batch"][0]["__key__"].startswith("s0")
    ns["c"].close()


def test_client_readme_first_example(make_daemon, monkeypatch):
    code = first_block(REPO / "clients" / "python" / "README.md", "pip install -e clients/python")
    d = make_daemon()
    monkeypatch.setenv("CKPTD_SOCKET", d.socket)
    model = torch.nn.Linear(8, 4)
    ns = run(code, model, "clients/python/README.md")
    assert ns["state"].metadata == b"loader position"
    assert isinstance(ns["state"]["model"]["weight"], torch.Tensor)
    assert isinstance(ns["state"]["step"], np.ndarray)
