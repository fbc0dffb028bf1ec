"""Attempts: every save names the run it belongs to (contracts, section 1)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import ckptd
import ckptd.torch as ct


@pytest.fixture(autouse=True)
def no_attempt_env(monkeypatch):
    monkeypatch.delenv("CKPTD_ATTEMPT", raising=False)


@pytest.mark.parametrize("attempt", ["12345-0", "a", "run.3_x", "0" * 64, "x.."])
def test_valid_attempts(attempt):
    assert ckptd.Client("/nonexistent.sock", attempt=attempt).attempt == attempt


@pytest.mark.parametrize("attempt", ["", "Run1", ".hidden", "a/b", "a b", "0" * 65, "é"])
def test_invalid_attempts_are_refused_at_once(attempt):
    with pytest.raises(ckptd.InvalidArgumentError, match="not a valid attempt"):
        ckptd.Client("/nonexistent.sock", attempt=attempt)


def test_attempt_from_the_environment(monkeypatch):
    monkeypatch.setenv("CKPTD_ATTEMPT", "4242-1")
    assert ckptd.Client("/nonexistent.sock").attempt == "4242-1"
    assert ckptd.Client("/nonexistent.sock", attempt="mine").attempt == "mine"  # argument wins
    monkeypatch.setenv("CKPTD_ATTEMPT", "Job/1")
    with pytest.raises(ckptd.InvalidArgumentError, match=r"\$CKPTD_ATTEMPT 'Job/1'"):
        ckptd.Client("/nonexistent.sock")


def test_random_attempt_per_client(monkeypatch):
    monkeypatch.setenv("CKPTD_ATTEMPT", "")  # empty counts as unset
    a, b = ckptd.Client("/nonexistent.sock").attempt, ckptd.Client("/nonexistent.sock").attempt
    assert re.fullmatch(r"[0-9a-f]{16}", a) and re.fullmatch(r"[0-9a-f]{16}", b)
    assert a != b


def test_every_save_and_wait_carries_the_attempt(daemon, job):
    with daemon.client(attempt="run-7") as c:
        sent = []
        begin = c._conn.stub.BeginSave

        def spy(req, **kw):
            sent.append(req.target.attempt)
            return begin(req, **kw)

        c._conn.stub.BeginSave = spy
        h = c.save(1, {"a": np.zeros(3)}, job=job)
        assert sent == ["run-7"] and h.attempt == "run-7"
        assert h._request().attempt == "run-7"
        h.wait(30)
        h2 = c.save(2, {"a": np.zeros(3)}, job=job, attempt="other-run")
        assert sent[-1] == "other-run" and h2.attempt == "other-run"
        h2.wait(30)
        assert c.handle(1, job=job).attempt == "run-7"  # the client's attempt
        assert c.handle(1, job=job, attempt="").attempt == ""  # whichever the daemon knows
        c.handle(1, job=job).wait(30)
        with pytest.raises(ckptd.InvalidArgumentError):
            c.save(3, {"a": np.zeros(1)}, job=job, attempt="UPPER")
        with pytest.raises(ckptd.InvalidArgumentError):
            c.handle(1, job=job, attempt="UPPER")


def test_stream_saves_carry_the_attempt(daemon, job):
    with daemon.client(transport="stream", attempt="streamed") as c:
        sent = []
        stream = c._conn.stub.SaveStream

        def spy(messages, **kw):
            def tap():
                for m in messages:
                    if m.HasField("header"):
                        sent.append(m.header.target.attempt)
                    yield m

            return stream(tap(), **kw)

        c._conn.stub.SaveStream = spy
        c.save(1, {"a": np.zeros(3)}, job=job).wait(30)
        assert sent == ["streamed"]


def test_random_attempt_warns_once_when_ranks_must_share_it(daemon, job):
    with daemon.client() as c, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        h0 = c.save(1, {"a": np.zeros(1)}, rank=0, world_size=2, job=job)
        h1 = c.save(1, {"a": np.zeros(1)}, rank=1, world_size=2, job=job)
        h0.wait(30)
        h1.wait(30)
    [w] = [w for w in rec if "attempt" in str(w.message)]  # once per client
    assert w.category is RuntimeWarning
    assert c.attempt in str(w.message) and "CKPTD_ATTEMPT=$SLURM_JOB_ID" in str(w.message)
    for step, kw in enumerate(({"attempt": "given"}, {}), start=2):
        with daemon.client(**kw) as c, warnings.catch_warnings():
            warnings.simplefilter("error")
            # Given an attempt, or saving a single rank: nothing to warn about.
            if kw:
                c.save(step, {"a": np.zeros(1)}, rank=0, world_size=2, job=job)
            c.save(step + 10, {"a": np.zeros(1)}, job=job).wait(30)


def test_torch_helpers_without_distributed_use_the_clients_attempt(daemon, job):
    assert not torch.distributed.is_initialized()
    with daemon.client() as c:
        h = ct.save_state_dict(c, 1, torch.nn.Linear(2, 2), job=job)
        assert h.attempt == c.attempt
        h = ct.save_state_dict(c, 2, torch.nn.Linear(2, 2), job=job, attempt="explicit")
        assert h.attempt == "explicit"
        h.wait(30)
