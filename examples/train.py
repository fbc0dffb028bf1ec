"""A small CPU training loop that checkpoints through ckptd asynchronously.

It fits a noisy linear target with an MLP (with dropout, so the global RNG
matters) on synthetic data, and every --ckpt-every steps hands model,
optimizer and RNG states to the ckptd daemon -- the loop stalls only for the
copy into shared memory. Kill it at any point; ``--resume latest`` picks up
from the newest committed step and ends with the same weights, bit for bit,
as a run that was never interrupted:

    ckptd serve &                                   # or: make run
    python examples/train.py --steps 200 --ckpt-every 20
    python examples/train.py --steps 200 --ckpt-every 20 --resume latest

The last line printed is a SHA-256 of the final weights, to compare runs.

On SIGTERM or SIGUSR1 (a preemption: Slurm's ``--signal=USR1@90``, a pod
being deleted) it checkpoints the step it is in, waits until the step is
committed and exits 0; ``--resume latest`` goes on from there, to the same
final weights.

A resumed run is a new attempt (see the client README): it redoes the steps
after the checkpoint it resumed from, and a step that the killed run had
already checkpointed -- committed by the daemon after the kill -- is skipped
with a line saying so. Training is deterministic, so that checkpoint holds
the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import time
from typing import Literal

import torch

import ckptd
import ckptd.torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--resume", default=None, help="'latest' or a step number to resume from")
    p.add_argument("--job", default=None, help="ckptd job name (default: the daemon's)")
    p.add_argument(
        "--socket", default=None, help="daemon socket (default: $CKPTD_SOCKET or ckptd's default)"
    )
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds to sleep per step (to watch it)"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(
    seed: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator, torch.Tensor]:
    """The model, optimizer, data generator and target weights, all from seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    data = torch.Generator().manual_seed(seed + 1)
    w_true = torch.randn(16, 1, generator=data)
    return model, opt, data, w_true


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Generator, w_true: torch.Tensor
) -> float:
    """One optimizer step on a fresh synthetic batch."""
    x = torch.randn(32, 16, generator=data)
    y = x @ w_true + 0.1 * torch.randn(32, 1, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss)


def resume(
    client: ckptd.Client,
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: torch.Generator,
) -> int:
    """Restore the requested checkpoint; return the step it was taken after."""
    step: int | Literal["latest"] = "latest" if args.resume == "latest" else int(args.resume)
    try:
        extra = ckptd.torch.load_state_dict(client, step, model, optimizer=opt, job=args.job)
    except ckptd.NotFoundError:
        if step != "latest":
            raise
        print("no committed checkpoint yet; starting from scratch", flush=True)
        return 0
    torch.set_rng_state(extra["torch_rng"])
    data.set_state(extra["data_rng"])
    print(f"resumed from step {extra['step']}", flush=True)
    return extra["step"]


def checkpoint(
    client: ckptd.Client,
    args: argparse.Namespace,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: torch.Generator,
) -> ckptd.SaveHandle | None:
    """Stage a checkpoint of everything the next step depends on."""
    extra = {"step": step, "torch_rng": torch.get_rng_state(), "data_rng": data.get_state()}
    try:
        h = ckptd.torch.save_state_dict(
            client, step, model, optimizer=opt, extra=extra, job=args.job
        )
    except ckptd.AlreadyExistsError as e:
        owner = committed_elsewhere(client, args.job, step, e)
        if owner is None:
            raise  # not another run's commit: a real problem
        print(f"step {step} was already committed by {owner}; not saving it again", flush=True)
        return None
    print(f"saved step {step}", flush=True)
    return h


def committed_elsewhere(
    client: ckptd.Client, job: str | None, step: int, err: ckptd.AlreadyExistsError
) -> str | None:
    """Who committed step, when another attempt (an earlier run) did; else None.

    The daemon says so with reason STEP_COMMITTED and the committing attempt.
    A daemon that gives no reason is asked: its save of that step may still
    be draining, so wait for that (bounded), then look the step up.
    """
    if err.reason is not None:
        owner = err.metadata.get("attempt", "")
        if err.reason != "STEP_COMMITTED" or owner == client.attempt:
            return None
        return f"attempt {owner!r}" if owner else "an earlier run"
    with contextlib.suppress(ckptd.CkptdError):
        client.handle(step, job=job, attempt="").wait(timeout=60)
    return committed_by_another(client, job, step)


def committed_by_another(client: ckptd.Client, job: str | None, step: int) -> str | None:
    """Who committed step, when it is committed by another attempt than the client's."""
    for s in client.steps(job):
        if s.step == step and s.attempt != client.attempt:
            return f"attempt {s.attempt!r}" if s.attempt else "an earlier run"
    return None


def finish(client: ckptd.Client, job: str | None, h: ckptd.SaveHandle) -> None:
    """Wait for a checkpoint to commit; another run committing the step first is fine."""
    try:
        h.wait()
    except ckptd.AlreadyExistsError as e:  # refused after it was accepted
        owner = committed_elsewhere(client, job, h.step, e)
        if owner is None:
            raise
        print(f"step {h.step} was committed by {owner} first; keeping that", flush=True)
        return
    except ckptd.SaveFailedError:  # a daemon that gives no reason
        owner = committed_by_another(client, job, h.step)
        if owner is None:
            raise
        print(f"step {h.step} was committed by {owner} first; keeping that", flush=True)
        return
    print(f"committed step {h.step}", flush=True)


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes, to compare runs exactly."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Train, checkpointing asynchronously; print the final weights' digest."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # bit-exact across runs
    torch.use_deterministic_algorithms(True)
    model, opt, data, w_true = build(args.seed)
    pending: list[ckptd.SaveHandle] = []
    # SIGTERM (Kubernetes, systemd, torchrun passing one on) or SIGUSR1 (Slurm's
    # --signal=USR1@90) only sets a flag; the loop checkpoints at the end of
    # the step it is in, waits for the commit and stops.
    with ckptd.Client(args.socket) as client, ckptd.on_preemption() as preempt:
        start = resume(client, args, model, opt, data) if args.resume else 0
        for step in range(start + 1, args.steps + 1):
            loss = train_step(model, opt, data, w_true)
            print(f"step {step} loss {loss:.6f}", flush=True)
            stop = preempt.requested()  # between steps: the state is whole
            if (step % args.ckpt_every == 0 or stop) and (
                h := checkpoint(client, args, step, model, opt, data)
            ):
                pending.append(h)
            for h in [h for h in pending if h.done()]:
                finish(client, args.job, h)  # raises if the daemon gave up on it
                pending.remove(h)
            if stop:
                for h in pending:
                    finish(client, args.job, h)
                name = preempt.signal.name if preempt.signal else "a signal"
                print(
                    f"preempted by {name} after step {step}; resume with --resume latest",
                    flush=True,
                )
                return 0
            time.sleep(args.step_sleep)
        for h in pending:
            finish(client, args.job, h)
    print(f"final weights sha256 {weights_digest(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
