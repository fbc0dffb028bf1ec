"""rank and world_size defaults: the argument, torch.distributed, $RANK/$WORLD_SIZE, else 0/1.

A launcher of several processes without a rank to be found is an error,
never rank 0 of 1. The environment is cleared for each test (conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

import ckptd
from ckptd import _ranks


def test_a_single_process_is_rank_0_of_1():
    assert _ranks.resolve(None, None) == (0, 1)
    assert _ranks.rank(None) == 0


def test_given_values_win_over_everything(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _ranks.resolve(1, 2) == (1, 2)
    assert _ranks.resolve(1, None) == (1, 4)  # each one found only when not given
    assert _ranks.resolve(None, 8) == (3, 8)
    assert _ranks.rank(0) == 0


def test_rank_and_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")  # a launcher, but RANK says it all
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert _ranks.resolve(None, None) == (2, 4)
    assert _ranks.rank(None) == 2


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1"}, r"\$RANK is set but \$WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, r"\$WORLD_SIZE is set but \$RANK is not"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"\$RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, r"\$WORLD_SIZE='2.0' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"\$RANK=2 is not in \[0, \$WORLD_SIZE=2\)"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"\$RANK=-1 is not in"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"\$RANK=0 is not in \[0, \$WORLD_SIZE=0\)"),
    ],
)
def test_a_bad_environment_is_a_clear_error(monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        _ranks.resolve(None, None)


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ({"LOCAL_RANK": "0"}, "$LOCAL_RANK=0"),  # torchrun's, without its RANK
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, "$SLURM_NTASKS=8"),  # srun
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "$OMPI_COMM_WORLD_SIZE=2"),
        ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "$PMI_SIZE=4"),  # MPICH, Intel MPI
    ],
)
def test_a_launcher_without_a_rank_is_an_error_not_rank_0_of_1(monkeypatch, env, shown):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="cannot tell this process's rank") as e:
        _ranks.resolve(None, None)
    assert shown in str(e.value)
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS" in str(e.value)
    with pytest.raises(ValueError, match="cannot tell"):
        _ranks.resolve(0, None)  # the other one cannot be found either
    assert _ranks.resolve(0, 1) == (0, 1)  # both given: nothing to find


def test_a_launcher_of_one_task_is_a_single_process(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # e.g. a batch script, or srun -n1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert _ranks.resolve(None, None) == (0, 1)


def test_torch_distributed_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'g'}", rank=0, world_size=1)
    try:
        assert _ranks.resolve(None, None) == (0, 1)
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.delenv("RANK")
        monkeypatch.delenv("WORLD_SIZE")
        assert _ranks.resolve(None, None) == (0, 1)  # no error: torch knows
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="cannot tell"):
        _ranks.resolve(None, None)  # torch no longer knows, and the launcher remains


# ---- through the client, against a real daemon ----------------------------------


def test_save_load_and_handle_default_to_the_environments_rank(daemon, job, monkeypatch):
    with daemon.client(attempt="ranks-1") as c:
        handles = []
        for r in (0, 1):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv("WORLD_SIZE", "2")
            handles.append(c.save(1, {"w": np.full(4, float(r))}, job=job))
        assert [h.rank for h in handles] == [0, 1]
        assert c.handle(1, job=job).rank == 1  # RANK is still 1
        for h in handles:
            h.wait(30)
        [info] = c.steps(job)
        assert info.world_size == 2
        assert c.load(1, job=job)["w"][0] == 1.0  # this process's shard: rank 1
        assert c.load(1, rank=0, job=job)["w"][0] == 0.0


def test_a_launcher_without_a_rank_fails_before_saving(daemon, job, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with daemon.client() as c:
        with pytest.raises(ValueError, match=r"\$SLURM_NTASKS=4"):
            c.save(1, {"w": np.zeros(1)}, job=job)
        with pytest.raises(ValueError, match="cannot tell"):
            c.load("latest", job=job)
        with pytest.raises(ValueError, match="cannot tell"):
            ckptd.DatasetSpec("/data")
        assert c.steps(job) == []  # nothing was sent
        c.save(1, {"w": np.zeros(1)}, rank=0, world_size=1, job=job).wait(30)
        assert c.load("latest", rank=0, job=job).step == 1
