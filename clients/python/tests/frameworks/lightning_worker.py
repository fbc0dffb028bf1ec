"""A Lightning trainer checkpointing through ckptd.lightning.CheckpointIO.

    lightning_worker.py OUT TAG --job JOB --epochs E [--devices N] [--strategy ddp|mp]
                        [--resume] [--pause-at STEP]

Runs on the CPU (DDP over gloo with --devices 2: Lightning launches the
second process itself; --strategy mp: ckptd.lightning.ModelParallelStrategy
with the model sharded by FSDP2's fully_shard). Every epoch ModelCheckpoint saves a top-k file and
last.ckpt (two saves at one global step). Each rank appends its losses to
OUT/losses-TAG-rank<r>.txt; rank 0 writes OUT/final-TAG.json with the
weights', optimizer's and scheduler's state at the end. --pause-at STEP
stops rank 0 for good inside the save of STEP, once the state is staged
(OUT/paused is written then), for the test to kill it there. --resume
resumes with fit(ckpt_path="last").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import PausingClient, digest, log_loss, optimizer_digest

import ckptd.lightning


class Net(pl.LightningModule):
    def __init__(self, losses: Path) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.losses = losses

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        log_loss(self.losses, self.global_step, loss)
        return loss

    def configure_model(self):
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:  # not under ModelParallelStrategy
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("tag")
    p.add_argument("--job", required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause-at", type=int)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)

    client = None
    if a.pause_at is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        client = PausingClient(a.pause_at, a.out / "paused")
    io = ckptd.lightning.CheckpointIO(client, job=a.job)
    strategy = "ddp" if a.devices > 1 else "auto"
    plugins = [io]
    if a.strategy == "mp":
        strategy = ckptd.lightning.ModelParallelStrategy(client=client, job=a.job)
        plugins = []
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=a.out / "ckpts", every_n_epochs=1, save_last=True, save_top_k=-1
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=a.devices, strategy=strategy, max_epochs=a.epochs,
        plugins=plugins, callbacks=[ckpt], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=True,
    )  # fmt: skip
    model = Net(a.out / f"losses-{a.tag}-rank{trainer.global_rank}.txt")
    trainer.fit(model, loader, ckpt_path="last" if a.resume else None)
    if trainer.global_rank == 0:
        opt = trainer.optimizers[0]
        final = {
            "step": trainer.global_step,
            "weights": digest(*model.parameters()),  # under mp: rank 0's pieces
            "optimizer": optimizer_digest(opt),
            "lr": [g["lr"].hex() for g in opt.param_groups],
        }
        (a.out / f"final-{a.tag}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main()
