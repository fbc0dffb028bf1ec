"""A transformers Trainer (a tiny GPT-2, CPU) checkpointing through ckptd.hf.Trainer.

    hf_worker.py OUT TAG --job JOB [--resume] [--pause-at STEP]

Saves every 6 of 24 steps. With RANK, WORLD_SIZE, ... set (as torchrun
sets them) it runs DDP over gloo. Each rank appends its losses to
OUT/losses-TAG-rank<r>.txt; rank 0 writes OUT/final-TAG.json (weights,
AdamW state, LR) at the end. --pause-at STEP stops inside the save of STEP once it is
staged (OUT/paused then exists); --resume trains with
resume_from_checkpoint=True.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from common import PausingClient, digest, log_loss, optimizer_digest

import ckptd.hf


class Logged(ckptd.hf.Trainer):
    def __init__(self, *a, losses: Path, **kw) -> None:
        super().__init__(*a, **kw)
        self.losses = losses

    def compute_loss(self, model, inputs, *a, **kw):
        loss = super().compute_loss(model, inputs, *a, **kw)
        log_loss(self.losses, self.state.global_step + 1, loss)
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("tag")
    p.add_argument("--job", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause-at", type=int)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    transformers.set_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)  # dropout on: the RNG states matter
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(a.out / "hf"), max_steps=24, save_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="inverse_sqrt", warmup_steps=2, seed=0, use_cpu=True,
        report_to="none", logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    client = None
    if a.pause_at is not None and args.process_index == 0:
        client = PausingClient(a.pause_at, a.out / "paused")
    trainer = Logged(
        model=model, args=args, train_dataset=data, ckptd_client=client, ckptd_job=a.job,
        losses=a.out / f"losses-{a.tag}-rank{args.process_index}.txt",
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if args.process_index != 0:
        return
    final = {
        "step": trainer.state.global_step,
        "weights": digest(*model.parameters()),
        "optimizer": optimizer_digest(trainer.optimizer.optimizer),
        "lr": [x.hex() for x in trainer.lr_scheduler.get_last_lr()],
    }
    (a.out / f"final-{a.tag}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main()
