"""Trainer-visible save stall of the framework adapters against each framework's own saves.

One GPT-2 (transformers, random weights) with its AdamW state, on the CPU,
saved the way each framework saves a checkpoint during training, and the
same state through ckptd's adapter for it, in one run on one machine:

- Lightning: the CheckpointIO plugins' save_checkpoint on the checkpoint
  dict the Trainer builds (its state_dict and optimizer_states): plain
  TorchCheckpointIO, AsyncCheckpointIO (which clones every tensor before
  it hands the save to its thread), and ckptd.lightning.CheckpointIO;
- transformers: Trainer._save_checkpoint (what save_steps calls) of
  transformers.Trainer and of ckptd.hf.Trainer;
- accelerate: accelerator.save_state(dir) and ckptd.accelerate.save_state.

The stall is the time the call keeps the trainer: for the asynchronous
ones (AsyncCheckpointIO, ckptd) the save's background work is waited for
after the clock stops, before the next save, so saves never overlap. Each
figure is the median of --repeat saves; the ratio is ckptd's stall over
the best of the framework's own options. The files go to --dir (a
page-cached disk: the framework's best case).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def parse_args() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="GPT-2 layers (6: ~580 MiB with AdamW)")
    p.add_argument("--repeat", type=int, default=5, help="saves of each method (the median counts)")
    p.add_argument(
        "--dir", default=None, help="where the frameworks' files go (default: a tmp dir)"
    )
    p.add_argument("--ckptd", default=None, help="a ckptd binary (default: go build one)")
    return p.parse_args()


def timed(save: Callable[[int], object], settle: Callable[[object], None], repeat: int) -> float:
    """Median seconds of save(i), each one's background work settled before the next."""
    times = []
    for i in range(1, repeat + 1):
        t0 = time.perf_counter()
        out = save(i)
        times.append(time.perf_counter() - t0)
        settle(out)
    return statistics.median(times)


def model_and_optimizer(layers: int):  # noqa: ANN201 - torch and transformers objects
    """A GPT-2 with populated AdamW state (one optimizer step taken)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=512, n_head=8, n_positions=256)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def nbytes(model, opt) -> int:  # noqa: ANN001
    """Bytes of the model's parameters and the optimizer's state."""
    import torch

    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def bench_lightning(sock: str, disk: Path, model, opt, repeat: int) -> dict[str, float]:  # noqa: ANN001
    """Lightning's CheckpointIO plugins on the checkpoint dict its Trainer saves."""
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    import ckptd
    import ckptd.lightning

    def checkpoint(step: int) -> dict[str, object]:
        return {
            "epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6",
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [], "loops": {}, "callbacks": {},
        }  # fmt: skip

    out: dict[str, float] = {}
    plain = TorchCheckpointIO()
    out["TorchCheckpointIO"] = timed(
        lambda i: plain.save_checkpoint(checkpoint(i), disk / f"plain-{i}.ckpt"),
        lambda _: None,
        repeat,
    )
    asyncio_ = AsyncCheckpointIO(TorchCheckpointIO())

    def drain_async(_: object) -> None:
        asyncio_.teardown()  # waits for the thread's save

    out["AsyncCheckpointIO"] = timed(
        lambda i: asyncio_.save_checkpoint(checkpoint(i), disk / f"async-{i}.ckpt"),
        drain_async,
        repeat,
    )
    with ckptd.Client(sock) as c:
        io = ckptd.lightning.CheckpointIO(c, job="lightning")

        def settle(_: object) -> None:
            io.teardown()

        out["ckptd"] = timed(
            lambda i: io.save_checkpoint(checkpoint(i), disk / f"ckptd-{i}.ckpt"), settle, repeat
        )
    return out


def bench_hf(sock: str, disk: Path, model, opt, repeat: int) -> dict[str, float]:  # noqa: ANN001
    """transformers.Trainer._save_checkpoint, its own and ckptd.hf's."""
    import torch
    import transformers

    import ckptd
    import ckptd.hf

    def trainer(cls: type, folder: str, **kw: object):  # noqa: ANN202
        args = transformers.TrainingArguments(
            output_dir=str(disk / folder), use_cpu=True, report_to="none", save_steps=1
        )
        t = cls(model=model, args=args, optimizers=(opt, None), **kw)
        t.create_optimizer_and_scheduler(num_training_steps=100)
        t.optimizer = t.accelerator.prepare(opt)
        return t

    out: dict[str, float] = {}
    own = trainer(transformers.Trainer, "hf")

    def save(t) -> Callable[[int], None]:  # noqa: ANN001
        def run(i: int) -> None:
            t.state.global_step = i
            t._save_checkpoint(t.model, None)

        return run

    out["Trainer save"] = timed(save(own), lambda _: None, repeat)
    with ckptd.Client(sock) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = trainer(ckptd.hf.Trainer, "hf-ckptd", ckptd_client=c, ckptd_job="hf")
        out["ckptd"] = timed(save(mine), lambda _: mine.ckptd_wait(600), repeat)
    del torch
    return out


def bench_accelerate(sock: str, disk: Path, model, opt, repeat: int) -> dict[str, float]:  # noqa: ANN001
    """accelerator.save_state against ckptd.accelerate.save_state."""
    import accelerate

    import ckptd
    import ckptd.accelerate

    acc = accelerate.Accelerator(cpu=True)
    pmodel, popt = acc.prepare(model, opt)
    out: dict[str, float] = {}
    out["save_state"] = timed(
        lambda i: acc.save_state(str(disk / f"acc-{i}")), lambda _: None, repeat
    )
    with ckptd.Client(sock) as c:

        def settle(h: object) -> None:
            if h is not None:
                h.wait(600)  # type: ignore[attr-defined]

        out["ckptd"] = timed(
            lambda i: ckptd.accelerate.save_state(acc, i, client=c, job="accelerate"),
            settle,
            repeat,
        )
    del pmodel, popt
    return out


def table(results: dict[str, dict[str, float]], size: int) -> str:
    """The stalls and ckptd's ratio to the best of each framework's own options."""
    lines = [
        f"trainer-visible save stall, GPT-2 with AdamW ({size / 2**20:.0f} MiB), CPU",
        f"{'framework':<14}{'its own option':<22}{'stall':>10}{'ckptd':>10}{'ratio':>8}",
    ]
    for fw, res in results.items():
        own = {k: v for k, v in res.items() if k != "ckptd"}
        for name, t in own.items():
            lines.append(
                f"{fw:<14}{name:<22}{t * 1e3:>8.0f}ms{res['ckptd'] * 1e3:>8.0f}ms"
                f"{res['ckptd'] / t:>8.2f}"
            )
        best = min(own.values())
        lines.append(f"{fw:<14}{'(best of its own)':<22}{best * 1e3:>8.0f}ms"
                     f"{res['ckptd'] * 1e3:>8.0f}ms{res['ckptd'] / best:>8.2f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    """Build, serve, save each way, print the table."""
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _serve import serve

    out = Path(tempfile.mkdtemp(prefix="bench-frameworks-"))
    disk = Path(args.dir) if args.dir else out / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    binary = args.ckptd
    if binary is None:
        binary = str(out / "ckptd")
        subprocess.run(["go", "build", "-o", binary, "./cmd/ckptd"], cwd=REPO, check=True)
    model, opt = model_and_optimizer(args.layers)
    size = nbytes(model, opt)
    staging = f"{size * 3 // 2**20 + 256}MiB"  # room for a save while the last one drains
    results: dict[str, dict[str, float]] = {}
    try:
        with serve(binary, "frameworks", "--storage", str(out / "store"), "--staging-bytes",
                   staging) as sock:  # fmt: skip
            for name, fn in (
                ("Lightning", bench_lightning),
                ("transformers", bench_hf),
                ("accelerate", bench_accelerate),
            ):
                results[name] = fn(sock, disk, model, opt, max(1, args.repeat))
                shutil.rmtree(disk, ignore_errors=True)
                disk.mkdir(parents=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(table(results, size))


if __name__ == "__main__":
    main()
