"""Bad input and failures get clear exceptions, and change nothing."""

from __future__ import annotations

import os
import socket
import tempfile

import numpy as np
import pytest
import torch

import ckptd

MiB = 1 << 20


def test_no_daemon_names_the_socket_and_says_what_to_do():
    # A short folder under /tmp: unix socket paths are limited to 108 bytes.
    with (
        tempfile.TemporaryDirectory(prefix="ckptd-none-") as folder,
        ckptd.Client(sock := os.path.join(folder, "absent.sock"), reconnect_timeout=0) as c,
    ):
        for call in (c.steps, lambda: c.save(1, {"a": np.zeros(1)}), lambda: c.load("latest")):
            with pytest.raises(ckptd.DaemonUnavailableError) as e:
                call()
            assert sock in str(e.value)
            assert "ckptd serve" in str(e.value)
            assert isinstance(e.value, ConnectionError)


def test_default_socket_matches_the_daemons_rule(monkeypatch):
    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/var/tmp/")  # no longer part of the rule
    assert ckptd.default_socket() == f"/tmp/ckptd-{os.getuid()}/ckptd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")  # empty counts as unset
    assert ckptd.default_socket() == f"/tmp/ckptd-{os.getuid()}/ckptd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000/")
    assert ckptd.default_socket() == "/run/user/1000/ckptd.sock"
    monkeypatch.setenv("CKPTD_SOCKET", "/run/x.sock")
    assert ckptd.default_socket() == "/run/x.sock"
    assert ckptd.Client().socket == "/run/x.sock"


def test_unknown_step_and_rank(client, job):
    with pytest.raises(ckptd.NotFoundError, match="step 99"):
        client.load(99, job=job)
    with pytest.raises(ckptd.NotFoundError):
        client.load("latest", job=job)
    client.save(1, {"a": np.zeros(1)}, job=job).wait(30)
    with pytest.raises(ckptd.InvalidArgumentError, match="rank 3 out of range"):
        client.load(1, rank=3, job=job)
    assert client.load(1, job=job)["a"][0] == 0.0  # the client still works after errors


def test_step_saved_twice(client, job):
    client.save(1, {"a": np.zeros(1)}, job=job).wait(30)
    with pytest.raises(ckptd.AlreadyExistsError, match="already committed"):
        client.save(1, {"a": np.ones(1)}, job=job)
    assert client.load(1, job=job)["a"][0] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, "step -1 out of range"),
        ({"rank": 2, "world_size": 2, "attempt": "run-1"}, "rank 2 out of range"),
        ({"world_size": 0}, "world_size 0 out of range"),
        ({"job": "../escape"}, "job name"),
        ({"step": 1 << 63}, "out of range"),
    ],
)
def test_daemon_refuses_bad_targets(client, job, kwargs, match):
    args = {"step": 1, "job": job, **kwargs}
    with pytest.raises(ckptd.InvalidArgumentError, match=match):
        client.save(state={"a": np.zeros(1)}, **args)
    assert client.steps(job) == []


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"a": [1, 2]}, TypeError, "must be numpy arrays or torch tensors"),
        ({"a": 3.0}, TypeError, "numpy.asarray"),
        ({"a": np.zeros(2, np.clongdouble)}, TypeError, "complex256.*complex64/128"),
        ({"a": np.array(["x"])}, TypeError, "<U1"),
        ({"a": np.zeros(2, object)}, TypeError, "object"),
        ({"a": torch.empty(2, dtype=torch.qint8)}, TypeError, "quantized tensor .*int_repr"),
        ({"a": torch.zeros(2).to_sparse()}, TypeError, "dense"),
        ({"a": torch.zeros(2, device="meta")}, TypeError, "meta"),
        ({"a": {}}, ckptd.InvalidArgumentError, "empty dict"),
        ({1: np.zeros(1)}, TypeError, "keys must be str"),
        ({"__metadata__": np.zeros(1)}, ckptd.InvalidArgumentError, "'__metadata__'.*safetensors"),
        ("not a dict", TypeError, "must be a dict"),
    ],
)
def test_bad_state_is_refused_before_anything_is_staged(client, job, state, error, match):
    with pytest.raises(error, match=match):
        client.save(1, state, job=job)
    client.save(1, {"ok": np.zeros(1)}, job=job).wait(30)  # nothing half-staged blocks it


def test_bad_arguments(client, job):
    with pytest.raises(TypeError, match="encode"):
        client.save(1, {"a": np.zeros(1)}, metadata="text", job=job)
    with pytest.raises(ckptd.InvalidArgumentError, match="at most"):
        client.save(1, {"a": np.zeros(1)}, metadata=bytes(17 << 20), job=job)
    with pytest.raises(TypeError, match="step must be an int"):
        client.save(1.5, {"a": np.zeros(1)}, job=job)
    with pytest.raises(ValueError, match='an int or "latest"'):
        client.load("newest")
    with pytest.raises(TypeError, match='an int or "latest"'):
        client.load(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positional"):
        client.load(3, 0)  # type: ignore[misc]
    with pytest.raises(ValueError, match="transport"):
        ckptd.Client(transport="tcp")  # type: ignore[arg-type]


def test_arena_full_then_recovers(make_daemon, job):
    d = make_daemon("--staging-wait", "300ms", "--debug-drain-delay", "2s", staging="8MiB")
    with d.client() as c:
        h1 = c.save(1, {"a": np.zeros(6 * MiB, np.uint8)}, job=job)
        with pytest.raises(ckptd.ResourceExhaustedError, match="arena full") as e:
            c.save(2, {"a": np.ones(6 * MiB, np.uint8)}, job=job)
        assert "8388608" in str(e.value)  # names the budget
        h1.wait(30)  # draining frees the region
        c.save(2, {"a": np.ones(6 * MiB, np.uint8)}, job=job).wait(30)
        assert c.load(2, job=job)["a"].sum() == 6 * MiB
        with pytest.raises(
            ckptd.ResourceExhaustedError, match=r"larger than the arena.*--staging-bytes"
        ):
            c.save(3, {"a": np.zeros(9 * MiB, np.uint8)}, job=job)


def test_closed_client(daemon):
    c = daemon.client()
    c.close()
    c.close()  # twice is fine
    with pytest.raises(ckptd.ClientClosedError):
        c.steps()
    with pytest.raises(ckptd.ClientClosedError):
        c.save(1, {"a": np.zeros(1)})


def test_every_error_is_a_ckptd_error():
    for name in ckptd.__all__:
        obj = getattr(ckptd, name)
        if isinstance(obj, type) and name.endswith("Error"):
            assert issubclass(obj, ckptd.CkptdError)
    assert issubclass(ckptd.TimeoutError, TimeoutError)
    assert issubclass(ckptd.InvalidArgumentError, ValueError)
    assert issubclass(ckptd.NotFoundError, LookupError)


def test_unmappable_arena_falls_back_to_streaming(make_daemon, job):
    """As for a client in a container that does not share the daemon's /dev/shm."""
    d = make_daemon()
    (d.arena_dir / "arena").unlink()  # the daemon keeps its own mapping
    with d.client(transport="shm") as c, pytest.raises(ckptd.CkptdError, match="cannot map"):
        c.save(1, {"a": np.zeros(1)}, job=job)
    with d.client() as c:
        with pytest.warns(RuntimeWarning, match="streaming"):
            c.save(1, {"a": np.arange(5)}, job=job).wait(30)
        assert c.transport == "stream"
        assert np.array_equal(c.load(1, job=job)["a"], np.arange(5))


def test_dead_storage_is_storage_unavailable(make_daemon):
    """The daemon answers, its store does not: not "no daemon on the socket"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host, port = s.getsockname()
        dead = f"http://{host}:{port}"
    d = make_daemon("--s3-endpoint", dead, "--s3-region", "us-east-1", "--s3-retry-deadline", "1s")
    with d.client() as c:
        with pytest.raises(ConnectionError, match="storage unavailable") as e:
            c.dataset(ckptd.DatasetSpec("s3://bucket/shards/", batch_size=4))
        assert dead in str(e.value)
        # The class comes from the daemon's ErrorInfo reason, never from the
        # words of its message; a daemon that sends no reason leaves only the
        # status code, UNAVAILABLE, which reads as "no daemon".
        if e.value.reason is None:
            assert type(e.value) is ckptd.DaemonUnavailableError
        else:
            assert e.value.reason == "STORAGE_UNAVAILABLE"
            assert isinstance(e.value, ckptd.StorageUnavailableError)
            assert "ckptd serve" not in str(e.value)
        c.steps()  # the daemon itself is fine
