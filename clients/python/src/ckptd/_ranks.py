"""This process's rank and world size, when the caller does not give them.

In order, the first that applies:

1. the arguments the caller gave;
2. torch.distributed, when it is imported and initialized: get_rank() and
   get_world_size() of the default group;
3. ``$RANK`` and ``$WORLD_SIZE`` (torchrun, torch.distributed.launch,
   DeepSpeed, Accelerate and most launchers set them): both must be set,
   ints, with 0 <= RANK < WORLD_SIZE;
4. rank 0 of 1, unless a launcher of several processes is detected --
   ``$LOCAL_RANK`` (torchrun), ``$SLURM_NTASKS`` > 1 (srun),
   ``$OMPI_COMM_WORLD_SIZE`` > 1 (Open MPI), ``$PMI_SIZE`` > 1 (MPICH,
   Intel MPI): then ValueError, since rank 0 of 1 would be wrong in every
   process but one, and silently so (a step commits only once all of its
   world_size ranks saved).

Slurm's and MPI's own variables are signs of a launcher, never a source of
the rank: in a batch script itself, and in the processes mpirun starts
under Slurm, ``$SLURM_PROCID`` and ``$SLURM_NTASKS`` describe the job step,
not this process. Export ``RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS``
in an srun step to use them.

torch is never imported here: if it is not imported yet, torch.distributed
cannot be initialized in this process.
"""

from __future__ import annotations

import os
import sys

# What shows that a launcher started several processes: $LOCAL_RANK set at
# all (torchrun), or a world size other than 1.
_LOCAL_RANK = "LOCAL_RANK"
_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_HOWTO = (
    "pass rank= and world_size=, initialize torch.distributed first, or set RANK and "
    "WORLD_SIZE (e.g. RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS in an srun step)"
)


def resolve(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each given one as it is, the others found (see the module).

    Given values are not checked here: the daemon checks the pair, so that
    one rule holds for every client.

    Raises:
        ValueError: one is not given and cannot be determined, or the
            environment is inconsistent.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    found_rank, found_world = _detect()
    return (found_rank if rank is None else rank), (
        found_world if world_size is None else world_size
    )


def rank(rank: int | None) -> int:
    """This process's rank unless given (see resolve())."""
    return rank if rank is not None else resolve(None, None)[0]


def _detect() -> tuple[int, int]:
    """(rank, world_size) of this process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None or env_world is not None:
        if env_rank is None or env_world is None:
            given, missing = ("WORLD_SIZE", "RANK") if env_rank is None else ("RANK", "WORLD_SIZE")
            raise ValueError(f"${given} is set but ${missing} is not: set both, or neither")
        r, w = _env_int("RANK", env_rank), _env_int("WORLD_SIZE", env_world)
        if not 0 <= r < w:
            raise ValueError(f"$RANK={r} is not in [0, $WORLD_SIZE={w})")
        return r, w
    launcher = _launcher()
    if launcher:
        raise ValueError(
            f"cannot tell this process's rank: {launcher} shows a launcher of several "
            f"processes, but torch.distributed is not initialized and $RANK and $WORLD_SIZE "
            f"are not set; {_HOWTO}"
        )
    return 0, 1


def _env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _launcher() -> str:
    """The variable that shows a launcher of several processes, as name=value, or ""."""
    if _LOCAL_RANK in os.environ:
        return f"${_LOCAL_RANK}={os.environ[_LOCAL_RANK]}"
    for name in _SIZES:
        size = os.environ.get(name, "").strip()
        if size not in ("", "1"):
            return f"${name}={size}"
    return ""
