"""accelerate's save_state / load_state through ckptd.

    ckptd.accelerate.save_state(accelerator, step)      # instead of accelerator.save_state(dir)
    step = ckptd.accelerate.load_state(accelerator, "latest")

save_state stages one ckptd step, every process its shard, and returns
once the state is copied into the daemon's shared memory; ckptd drains and
commits it in the background (no folder is written, and nothing older is
deleted first). It covers what accelerator.save_state does: the prepared
models (the first one's tensors as ``model:<name>``, with its config.json
for ``ckptd export`` when it is a transformers model), optimizers,
schedulers, the gradient scaler, every process's RNG states, the
accelerator's step counter and the objects registered with
``register_for_checkpointing``. See docs/frameworks.md.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Literal

try:
    import accelerate
    from accelerate.utils import DistributedType
except ImportError as _err:  # pragma: no cover - depends on the environment
    from ._frameworks import missing

    raise missing("accelerate", "accelerate", _err) from None

import numpy as np
import torch

from . import _frameworks as fw
from . import torch as ct
from ._client import Client
from ._handle import SaveHandle

__all__ = ["load_state", "save_state"]

_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "XLA")


def save_state(
    accelerator: accelerate.Accelerator,
    step: int,
    *,
    client: Client | None = None,
    job: str | None = None,
    timeout: float | None = 600.0,
) -> SaveHandle | None:
    """Stage this process's shard of step: a collective, call it on every process.

    Args:
        accelerator: the Accelerator whose prepared objects to save.
        step: the training step (the ckptd step).
        client: the ckptd.Client (default: one on $CKPTD_SOCKET, or the
            daemon's default socket, kept for the process).
        job: the ckptd job (default: the daemon's).
        timeout: seconds to wait for the step when an earlier run committed
            it already (it is then compared, bit for bit).

    Under DDP (and on one process) the main process's shard holds the
    models, optimizers, schedulers, scaler and registered objects, every
    process's its RNG states; under FSDP2 every process holds its pieces of
    the first model and optimizer (ckptd.torch's DTensor format).

    Returns:
        The save's handle (wait() for it to commit), or None when an earlier
        run of the job committed this very state at step.

    Raises:
        NotImplementedError: DeepSpeed, Megatron-LM, XLA, or FSDP1 with
            more than one model.
        CkptdError: an earlier run committed step with other values.
    """
    kind = _check(accelerator)
    c = client or _default_client()
    rank, world = accelerator.process_index, accelerator.num_processes
    sharded = kind == "FSDP"
    main = rank == 0
    extra: dict[str, Any] = {"rng": _rng_states(), "step": accelerator.step}
    model: Any = {}
    optimizer = None
    if main or sharded:
        models, optims = accelerator._models, accelerator._optimizers
        if models:
            model = accelerator.unwrap_model(models[0])
        if optims:
            optimizer = optims[0].state_dict()
    if main:
        extra["models"] = [
            accelerator.unwrap_model(m).state_dict() for m in accelerator._models[1:]
        ]
        extra["optimizers"] = [o.state_dict() for o in accelerator._optimizers[1:]]
        extra["schedulers"] = [s.state_dict() for s in accelerator._schedulers]
        extra["custom"] = [o.state_dict() for o in accelerator._custom_objects]
        if accelerator.scaler is not None:
            extra["scaler"] = accelerator.scaler.state_dict()
    return fw.stage(
        c, step, model, optimizer=optimizer, extra=fw.portable(extra), rank=rank,
        world_size=world, job=job, timeout=timeout, resumed=accelerator in _RESUMED,
    )  # fmt: skip


def load_state(
    accelerator: accelerate.Accelerator,
    step: int | Literal["latest"] = "latest",
    *,
    client: Client | None = None,
    job: str | None = None,
    strict: bool = True,
    weights_only: bool = True,
) -> int | None:
    """Restore what save_state saved into the accelerator's prepared objects: a collective.

    Args:
        accelerator: the Accelerator, with the same objects prepared and
            registered (in the same order) as when the step was saved.
        step: the step, or "latest": the newest committed one (the main
            process's view, shared with every process).
        client: as save_state.
        job: as save_state.
        strict: passed to the models' load_state_dict.
        weights_only: True (default) refuses a step whose registered
            objects' states had values JSON cannot hold (they were pickled);
            False unpickles them: only for checkpoints you trust.

    Returns:
        The step loaded, or None when "latest" found no committed step
        (nothing is changed then).
    """
    kind = _check(accelerator)
    c = client or _default_client()
    rank = accelerator.process_index
    if step == "latest":
        latest = fw.agree(c.latest_step(job) if rank == 0 else None)
        if latest is None:
            return None
        step = latest
    sharded = kind == "FSDP"
    models, optims = accelerator._models, accelerator._optimizers
    from_rank = rank if sharded else 0
    main_extra = ct.load_state_dict(
        c, step, accelerator.unwrap_model(models[0]) if models else None,
        optimizer=optims[0] if optims else None, strict=strict, rank=from_rank, job=job,
    )  # fmt: skip
    if from_rank != 0:
        main_extra = fw.load(c, step, job=job, rank=0).extra
    extra = fw.unportable(main_extra, not weights_only, f"step {step}")
    own = extra if rank == 0 else fw.unportable(
        fw.load(c, step, job=job, rank=rank).extra, not weights_only, f"step {step} rank {rank}"
    )  # fmt: skip
    for m, sd in zip(models[1:], extra["models"], strict=True):
        accelerator.unwrap_model(m).load_state_dict(sd, strict=strict)
    for o, sd in zip(optims[1:], extra["optimizers"], strict=True):
        o.load_state_dict(sd)
    for s, sd in zip(accelerator._schedulers, extra["schedulers"], strict=True):
        s.load_state_dict(sd)
    for obj, sd in zip(accelerator._custom_objects, extra["custom"], strict=True):
        obj.load_state_dict(sd)
    if accelerator.scaler is not None and "scaler" in extra:
        accelerator.scaler.load_state_dict(extra["scaler"])
    accelerator.step = own["step"]
    _set_rng_states(own["rng"])
    _RESUMED.add(accelerator)
    return step


def _check(accelerator: accelerate.Accelerator) -> str:
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise NotImplementedError(
            f"ckptd.accelerate does not save {kind} state; use accelerator.save_state for it"
        )
    if accelerator.distributed_type == DistributedType.FSDP and len(accelerator._models) > 1:
        raise NotImplementedError("ckptd.accelerate saves one FSDP model per accelerator")
    return kind


_CLIENT: list[Client] = []
# Accelerators that load_state resumed: their saves first let an earlier
# run's save of the same step finish (ckptd._frameworks.settle_earlier_run).
_RESUMED: weakref.WeakSet[Any] = weakref.WeakSet()


def _default_client() -> Client:
    if not _CLIENT:
        _CLIENT.append(Client())
    return _CLIENT[0]


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
