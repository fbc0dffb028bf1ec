"""`ckptd serve --incremental`: a fine-tune's frozen weights are written once.

A real daemon saves a state whose backbone never changes and whose adapter
does, 10 steps: after the first, each step's folder holds the adapter's
bytes, not the model's. Deleting the step that holds the backbone, and
pruning between saves, keep what later steps reference: every kept step
loads exactly after each. verify, and a restarted daemon (which finds its
base in storage), keep it so.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np

import ckptd

CHUNK = 64 << 10


def _state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    backbone = rng.standard_normal(1 << 20, dtype=np.float32)  # 4 MiB, frozen
    adapter = np.random.default_rng(step).standard_normal(16 << 10, dtype=np.float32)  # 64 KiB
    return {"backbone": backbone, "adapter": adapter}


def _cli(binary, d, *args: str) -> str:
    out = subprocess.run(
        [str(binary), *args, "--storage", str(d.storage), "--job", "pytest"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def _written(binary, d) -> dict[int, int]:
    """Bytes each committed step's own folder holds (`list --all`)."""
    rows = json.loads(_cli(binary, d, "list", "--all", "--json"))
    return {r["step"]: r["bytes"] for r in rows if r["state"] == "committed"}


def _save(c: ckptd.Client, step: int) -> None:
    c.save(step, _state(step), rank=0, world_size=1).wait()


def _check(c: ckptd.Client, step: int) -> None:
    got = c.load(step, rank=0)
    for name, want in _state(step).items():
        np.testing.assert_array_equal(got[name], want)


def _steps(binary, d) -> list[int]:
    return [r["step"] for r in json.loads(_cli(binary, d, "list", "--json"))]


def test_frozen_weights_written_once(make_daemon, ckptd_bin) -> None:
    d = make_daemon("--incremental", "--chunk-size", "64KiB")
    with d.client() as c:
        for step in range(1, 5):
            _save(c, step)
        written = _written(ckptd_bin, d)
        full = written[1]
        # Each save pinned its base until its step committed, then let go.
        pins = d.storage / "pytest" / "pins"
        assert [p for p in pins.rglob("*") if p.is_file()] == []
        assert full > 3 << 20  # float-aware compression takes some
        for step in (2, 3, 4):
            assert written[step] < full * 0.05, written  # the adapter and manifests
        # Step 1 holds the backbone every later step references: deleting
        # it removes the step, not the chunks they need.
        _cli(ckptd_bin, d, "delete", "--step", "1")
        assert _steps(ckptd_bin, d) == [2, 3, 4]
        for step in range(5, 11):
            _save(c, step)
            assert _written(ckptd_bin, d)[step] < full * 0.05
            if step in (6, 8):  # prune between saves
                _cli(ckptd_bin, d, "prune", "--keep-last", "3")
            for kept in _steps(ckptd_bin, d):
                _check(c, kept)
        assert _steps(ckptd_bin, d) == [6, 7, 8, 9, 10]
    _cli(ckptd_bin, d, "verify", "--latest")
    _cli(ckptd_bin, d, "prune", "--keep-last", "1")
    d.kill9()  # a restarted daemon finds its base in storage
    d.start()
    with d.client() as c:
        _check(c, 10)
        _save(c, 11)
        assert _written(ckptd_bin, d)[11] < full * 0.05
        _check(c, 11)
    _cli(ckptd_bin, d, "verify", "--latest")
