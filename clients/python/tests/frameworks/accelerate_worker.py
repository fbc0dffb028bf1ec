"""An accelerate training loop checkpointing through ckptd.accelerate (CPU).

    accelerate_worker.py OUT TAG --job JOB [--resume] [--pause-at STEP]

Run one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set (DDP over gloo when WORLD_SIZE is 2). 24 steps of an MLP
with dropout, AdamW, a per-step LR schedule and a registered object; the
data are shuffled by accelerate's seedable sampler, 8 steps an epoch. A
save every 4 steps. Each rank appends its losses to
OUT/losses-TAG-rank<r>.txt; rank 0 writes OUT/final-TAG.json. --resume
loads "latest" and goes on from there; --pause-at STEP stops rank 0 inside
the save of STEP once staged (OUT/paused).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import accelerate
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import PausingClient, digest, log_loss, optimizer_digest

import ckptd
import ckptd.accelerate

STEPS, EVERY, PER_EPOCH = 24, 4, 8


class Counter:
    """A registered object: its state must come back too."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, sd) -> None:
        self.seen = sd["seen"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("tag")
    p.add_argument("--job", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause-at", type=int)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    acc = accelerate.Accelerator(
        cpu=True,
        dataloader_config=accelerate.DataLoaderConfiguration(use_seedable_sampler=True),
    )
    accelerate.utils.set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)

    rank = acc.process_index
    client = ckptd.Client()
    if a.pause_at is not None and rank == 0:
        client = PausingClient(a.pause_at, a.out / "paused")
    start, rng = 0, None
    if a.resume:
        start = ckptd.accelerate.load_state(acc, "latest", client=client, job=a.job) or 0
        # Mid-epoch, making the skipping iterator draws from torch's RNG, which the
        # uninterrupted run did before the save: put the restored state back after.
        rng = torch.get_rng_state()
        (a.out / f"resumed-{a.tag}-rank{rank}").write_text(str(start))
    losses = a.out / f"losses-{a.tag}-rank{rank}.txt"
    step = start
    handles = []
    while step < STEPS:
        epoch, skip = divmod(step, PER_EPOCH)
        loader.set_epoch(epoch)
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        for xb, yb in batches:
            if rng is not None:
                if skip:
                    torch.set_rng_state(rng)
                rng = None
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            counter.seen += len(xb)
            log_loss(losses, step, loss)
            if step % EVERY == 0:
                handles.append(ckptd.accelerate.save_state(acc, step, client=client, job=a.job))
            if step == STEPS:
                break
    for h in handles:
        if h is not None:
            h.wait(600)
    if rank == 0:
        final = {
            "step": step,
            "weights": digest(*acc.unwrap_model(model).parameters()),
            "optimizer": optimizer_digest(opt.optimizer),
            "lr": [v.hex() for v in sched.get_last_lr()],
            "seen": counter.seen,
        }
        (a.out / f"final-{a.tag}.json").write_text(json.dumps(final))
    acc.end_training()


if __name__ == "__main__":
    main()
