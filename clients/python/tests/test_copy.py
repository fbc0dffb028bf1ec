"""Host copies on several threads (ckptd._copy): exact, errors raised, safe after fork."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from ckptd import _copy


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of 1 MiB and up on three threads, in pieces of 64 KiB."""
    monkeypatch.setenv("CKPTD_COPY_THREADS", "3")
    monkeypatch.setattr(_copy, "SERIAL_BELOW", 1 << 20)
    monkeypatch.setattr(_copy, "PIECE", 64 << 10)


def pairs(rng: np.random.Generator) -> list[_copy.Pair]:
    """Contiguous, strided, 0-d, empty and odd-sized sources with fresh destinations."""
    srcs = [
        rng.integers(0, 256, 3 << 20, dtype=np.uint8),
        rng.standard_normal((512, 700)).astype(np.float32),
        rng.standard_normal((900, 300))[:, ::3],  # strided: copied whole
        np.asarray(7.5),
        np.empty((0, 4), np.int16),
        rng.integers(0, 2**31, 65537, dtype=np.int64),  # a last piece shorter than the rest
    ]
    return [(np.zeros(s.shape, s.dtype), s) for s in srcs]


@pytest.mark.usefixtures("three_threads")
def test_every_byte_lands_in_place():
    ps = pairs(np.random.default_rng(0))
    _copy.copy(ps)
    for dst, src in ps:
        np.testing.assert_array_equal(dst, src)


@pytest.mark.usefixtures("three_threads")
def test_torch_views_copy_bit_for_bit():
    src = torch.randn(1024, 1024).to(torch.bfloat16)
    dst = np.zeros(src.numel(), np.uint16)
    _copy.copy([(dst, src.view(torch.int16).numpy().view(np.uint16).reshape(-1))])
    got = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).view(1024, 1024)
    assert torch.equal(got, src)


@pytest.mark.usefixtures("three_threads")
def test_an_error_in_any_piece_is_raised():
    good = np.ones(4 << 20, np.uint8)
    bad = (np.zeros(10, np.float32), np.ones(10, np.float64))  # casting="equiv" refuses it
    out = np.zeros_like(good)
    with pytest.raises(TypeError):
        _copy.copy([(out, good), bad])
    seen = out.copy()  # the daemon may lease this memory again once copy() has returned
    time.sleep(0.05)
    np.testing.assert_array_equal(out, seen)


@pytest.mark.usefixtures("three_threads")
def test_an_interrupted_caller_returns_only_once_helpers_stopped(monkeypatch):
    """Ctrl-C in the caller's piece: no helper writes after copy() raised."""
    copyto, raised = np.copyto, []

    def interrupted(dst, src, casting):
        if threading.current_thread() is threading.main_thread() and not raised:
            raised.append(1)
            raise KeyboardInterrupt
        time.sleep(0.002)  # helpers slower than the caller: some are mid-piece
        copyto(dst, src, casting=casting)

    src = np.ones(8 << 20, np.uint8)
    out = np.zeros_like(src)
    monkeypatch.setattr(_copy.np, "copyto", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _copy.copy([(out, src)])
    monkeypatch.undo()
    seen = out.copy()
    time.sleep(0.05)
    np.testing.assert_array_equal(out, seen)
    assert int(seen.sum()) < src.size  # the caller stopped the copy


@pytest.mark.usefixtures("three_threads")
def test_concurrent_copies_do_not_wait_on_each_other():
    """Two threads saving at once each finish with their own bytes intact."""
    rng = np.random.default_rng(1)
    work = [pairs(rng) for _ in range(4)]
    errors: list[BaseException] = []

    def run(ps: list[_copy.Pair]) -> None:
        try:
            for _ in range(5):
                _copy.copy(ps)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(ps,)) for ps in work]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    for ps in work:
        for dst, src in ps:
            np.testing.assert_array_equal(dst, src)


@pytest.mark.usefixtures("three_threads")
def test_a_child_after_fork_copies_with_threads_of_its_own():
    _copy.copy(pairs(np.random.default_rng(2)))  # the parent's helpers exist now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = False
        try:
            ps = pairs(np.random.default_rng(3))
            _copy.copy(ps)
            ok = all(np.array_equal(d, s) for d, s in ps)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(("env", "want"), [("1", 1), ("6", 6)])
def test_threads_from_the_environment(monkeypatch, env, want):
    monkeypatch.setenv("CKPTD_COPY_THREADS", env)
    assert _copy.threads() == want


@pytest.mark.parametrize("env", ["0", "-2", "four"])
def test_bad_thread_counts_are_refused(monkeypatch, env):
    monkeypatch.setenv("CKPTD_COPY_THREADS", env)
    with pytest.raises(ValueError, match="CKPTD_COPY_THREADS"):
        _copy.threads()


def test_default_threads_fit_the_cpus(monkeypatch):
    monkeypatch.delenv("CKPTD_COPY_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert _copy.threads() == max(1, min(_copy.MAX_DEFAULT_THREADS, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))  # a rank per CPU: no helpers
    assert _copy.threads() == 1


@pytest.mark.usefixtures("three_threads")
def test_a_save_copied_on_threads_loads_bit_for_bit(client, job):
    rng = np.random.default_rng(4)
    state = {
        "big": torch.from_numpy(rng.standard_normal(1 << 20).astype(np.float32)),
        "strided": torch.from_numpy(rng.standard_normal((1024, 512)))[:, ::2],
        "bf16": torch.randn(700, 1000).to(torch.bfloat16),
        "small": np.arange(5, dtype=np.int8),
    }
    client.save(1, state, job=job).wait(60)
    got = client.load(1, job=job, as_torch=True)
    for k, v in state.items():
        want = torch.as_tensor(v)
        assert torch.equal(torch.as_tensor(got[k]), want), k
