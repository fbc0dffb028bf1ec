"""A daemon whose arena is shared with a group stores a save only as its client copied it.

With --socket-group, the group's members map the arena read-write, so one
could rewrite another user's staged bytes before they drain. The client
hashes what it copies (from its own memory) and the daemon checks the
hashes at drain: a rewrite fails the save, and nothing forged commits.
These run real `ckptd serve` processes, and the attacker is a real process
of another uid in the socket group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dcp_worker import diff as same
from launch import launch as run_workers
from test_dcp_parity import both, load_both, sample

import ckptd
from ckptd import _copy, _save

NOBODY = 65534
RESHARD = Path(__file__).with_name("dcp_reshard_worker.py")


def shared_daemon(make_daemon, *extra: str):
    d = make_daemon("--socket-group", str(NOBODY), "--chunk-size", "1MiB", *extra)
    os.chmod(d.dir, 0o755)
    return d


def awkward_state() -> dict[str, object]:
    """Tensors whose bytes the client must hash as copied, not as held."""
    rng = np.random.default_rng(3)
    big = torch.from_numpy(rng.standard_normal((1024, 1100)).astype(np.float32))
    return {
        "big": big,  # several chunks
        "strided": big.t()[:, ::3],  # a view: copied element by element
        "bf16": torch.arange(70_000, dtype=torch.float32).to(torch.bfloat16),
        "big_endian": np.arange(5000, dtype=">i4"),  # stored little-endian
        "empty": np.zeros((0, 4), np.float32),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "flags": np.array([True, False, True]),
        **{f"small.{i}": np.full(7 + i, i, np.int16) for i in range(300)},
    }


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_checked_save_commits_and_restores(make_daemon, job, transport):
    d = shared_daemon(make_daemon)
    state = awkward_state()
    with d.client(transport=transport) as c:
        c.save(1, state, job=job).wait()
        got = c.load(1, job=job)
        some = c.load(1, job=job, tensors=["small.299", "bf16"])  # whole chunks, checked
    assert set(some) == {"small.299", "bf16"}
    assert np.array_equal(some["small.299"], state["small.299"])
    assert torch.equal(torch.as_tensor(some["bf16"]), state["bf16"])
    for name, want in state.items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(torch.as_tensor(got[name]), want), name
        else:
            assert np.array_equal(np.asarray(got[name]), want), name


ATTACK = r"""
import mmap, sys
import numpy as np
path, victim, forged = sys.argv[1], np.float32(sys.argv[2]), np.float32(sys.argv[3])
pattern = np.full(4096, victim).tobytes()
with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
    at, found = m.find(pattern), 0
    while at >= 0:  # every copy: the victim's, and any stale one of freed regions
        m[at : at + len(pattern)] = np.full(4096, forged).tobytes()
        at, found = m.find(pattern, at + len(pattern)), found + 1
    if not found:
        sys.exit("the victim's bytes are not in the arena")
"""


def attack_as_member(d, victim: float, forged: float) -> None:
    """Rewrite the victim's staged bytes as uid 65534, a member of the socket group."""
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    arena = d.arena_dir / "arena"
    out = subprocess.run(
        [*drop, sys.executable, "-c", ATTACK, str(arena), str(victim), str(forged)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("memory", [False, True])
def test_group_member_cannot_forge_a_staged_save(make_daemon, job, memory):
    extra = ["--debug-drain-delay", "3s"]
    if memory:  # the second step stays in memory: the hot tier checks too
        extra += ["--hot-bytes", "64MiB", "--persist-every", "100"]
    d = shared_daemon(make_daemon, *extra)
    with d.client() as c:
        if memory:
            c.save(1, {"w": np.zeros(10, np.float32)}, job=job).wait()
        h = c.save(2, {"w": np.full(1 << 20, 1.5, np.float32)}, job=job)  # copied and accepted
        attack_as_member(d, 1.5, 666.0)
        with pytest.raises(ckptd.CkptdError, match="changed after the client copied them") as e:
            h.wait()
        assert e.value.reason == "CORRUPT"
        assert 2 not in c.steps(job)
        with pytest.raises(ckptd.CkptdError):
            c.load(2, job=job)
        assert "the staged bytes changed after the client copied them" in d.logs()


def test_group_member_cannot_forge_what_a_client_loads(make_daemon, job, monkeypatch):
    d = shared_daemon(make_daemon)
    with d.client() as c:
        c.save(1, {"w": np.full(1 << 20, 2.5, np.float32)}, job=job).wait()
        real = _copy.copy

        def copy_after_the_attack(pairs):  # the window between the restore and the copy out
            attack_as_member(d, 2.5, 666.0)
            monkeypatch.setattr(_copy, "copy", real)
            real(pairs)

        monkeypatch.setattr(_copy, "copy", copy_after_the_attack)
        with pytest.raises(ckptd.DataLossError, match="changed in the daemon's shared arena"):
            c.load(1, job=job)
        assert np.all(c.load(1, job=job)["w"] == 2.5)  # no attack this time


def test_dcp_through_a_shared_arena(make_daemon, job, tmp_path):
    """ckptd.dcp's held saves answer the check, and its partial reads are checked."""
    d = shared_daemon(make_daemon)
    sd = sample()
    with d.client() as c:
        both(c, job, tmp_path, sd, 1)
        fs, ours = load_both(c, job, tmp_path, sd, 1)
        some = load_both(c, job, tmp_path, {"model": {"bf16": sd["model"]["bf16"]}}, 1)
    assert same(ours, fs) == [] and same(ours, sd) == []
    assert same(some[1], some[0]) == []


def test_held_save_made_again_from_a_rewritten_region_is_refused(make_daemon, job):
    """ckptd.dcp's rank 0 may save its staged bytes again: only as they were hashed."""
    d = shared_daemon(make_daemon)
    with d.client() as c:
        target = _save.target(job, 1, 0, 1, "a1")
        held = _save.Held(c._conn, target, {"w": np.full(1 << 20, 4.5, np.float32)})
        try:
            assert np.all(held.staged_leaves()[0].value == 4.5)  # as staged: taken
            attack_as_member(d, 4.5, 666.0)
            with pytest.raises(ckptd.CkptdError, match="changed in the daemon's shared arena"):
                held.staged_leaves()
        finally:
            held.abort()


def test_dcp_resharding_load_through_a_shared_arena(make_daemon, tmp_path):
    """Slices of stored tensors come in whole chunks, checked; each lands where it should."""
    d = make_daemon("--socket-group", str(NOBODY), "--chunk-size", "64KiB")
    run_workers(RESHARD, "save", 2, d.socket, "reshard", tmp_path)
    run_workers(RESHARD, "load", 3, d.socket, "reshard", tmp_path)  # parts of tensors
    loaded = sum(int((tmp_path / f"loaded_3_{r}").read_text()) for r in range(3))
    assert loaded == 3 * 4 * 96 * 1024 * 4  # the worker checks each piece bit for bit
