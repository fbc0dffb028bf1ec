"""One rank of a torchtitan-style training run checkpointing through ckptd (test_torchtitan.py).

Usage: torchtitan_worker.py RANK WORLD INIT_FILE OUT_DIR CONFIG_JSON

torchtitan's own Trainer cannot train on a CPU (see docs/torchtitan.md):
this is its training loop, step for step (Trainer.train and train_step),
around torchtitan's real pieces: ckptd.torchtitan.CheckpointManager built
from its Config exactly as the Trainer builds config.checkpoint, torchtitan's
OptimizersContainer (AdamW) and LRSchedulersContainer (warmup, linear
decay), its ModelWrapper of the model parts, a Stateful data source and
the trainer's own train_state ({"step", "ntokens_seen"}). The model is a
small MLP sharded with FSDP2 over a CPU mesh of the WORLD gloo ranks.

CONFIG_JSON: the CheckpointManager.Config fields, plus "steps", and
"hold_at": a step at whose save the ranks stop (rank 0 right after its
save staged, the others before saving), write OUT_DIR/held-<rank> and wait
to be killed.

Rank 0 writes OUT_DIR/run.json: the loss of each step run (by step) and
the step it started from; OUT_DIR/state-<step>.pt, the full state (model,
optimizer, lr schedulers, data position) after each step, and
OUT_DIR/state-start.pt, the state the load gave.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dcp_worker import fsdp2
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from ckptd.torchtitan import CheckpointManager

BATCH, DIM = 4, 16


class Data(Stateful):
    """A data source whose batches depend on its position only (restored by load)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.position + self.rank)
        self.position += 1
        x = torch.randn(BATCH, DIM, generator=g)
        return x, x.roll(1, dims=1).sin()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict["position"]


class TrainState(Stateful):
    """What torchtitan's Trainer checkpoints of itself."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def full_state(model: torch.nn.Module, optimizers: Any, schedulers: Any, data: Data) -> Any:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizers.optimizers[0], options=opts)
    return {"model": msd, "optim": osd, "lr": schedulers.state_dict(), "data": data.state_dict()}


def main() -> None:
    rank, world, init, out, cfg_json = sys.argv[1:6]
    rank, world, out = int(rank), int(world), Path(out)
    cfg = json.loads(cfg_json)
    steps, hold_at = cfg.pop("steps"), cfg.pop("hold_at", None)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank, as torchtitan's seed
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.GELU(), torch.nn.Linear(32, 24), torch.nn.GELU(),
        torch.nn.Linear(24, DIM),
    )  # fmt: skip
    fsdp2(model, world)
    opt_cfg = default_adamw(lr=1e-2)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=steps
    )
    data, train_state = Data(rank), TrainState()
    config = CheckpointManager.Config(**cfg)  # the one line a recipe changes
    checkpointer = config.build(
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(out),
    )
    checkpointer.load(step=config.load_step)  # as Trainer.train
    start, losses = train_state.step, {}
    full = full_state(model, optimizers, schedulers, data)
    if rank == 0:
        torch.save(full, out / "state-start.pt")  # what the load gave
    while train_state.step < steps:
        train_state.step += 1
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += BATCH
        losses[train_state.step] = loss.item()
        full = full_state(model, optimizers, schedulers, data)
        if rank == 0:
            torch.save(full, out / f"state-{train_state.step}.pt")
        if train_state.step == hold_at and rank != 0:
            (out / f"held-{rank}").touch()
            time.sleep(3600)  # killed here, its save never made
        checkpointer.save(train_state.step, last_step=train_state.step == steps)
        if train_state.step == hold_at:
            (out / f"held-{rank}").touch()  # rank 0's save staged, its commit waiting
            time.sleep(3600)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    if rank == 0:
        (out / "run.json").write_text(json.dumps({"start": start, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
