"""Benchmark: torch.distributed.checkpoint through ckptd.dcp against DCP's own storage.

WORLD processes (gloo on the CPU) each hold a Shard(0) DTensor piece of the
same model state plus its AdamW state (exp_avg, exp_avg_sq: 3x the
weights, float32, random), SIZE in all, and save it, one after the other,
to the same local disk:

    memcpy           a copy of the rank's tensors into fresh memory: the floor
    dcp async        dcp.async_save with DCP's default stager (a CPU copy)
                     and FileSystemWriter, the thread-based checkpointer
    dcp async proc   the same with the process-based checkpointer
    ckptd.dcp async  dcp.async_save with ckptd.dcp.Writer (stage() copies
                     into the daemon's arena)
    dcp save         dcp.save with FileSystemWriter (blocks until written)
    ckptd.dcp save   dcp.save with ckptd.dcp.Writer (blocks until committed)

With torchtitan installed, the same bytes as a model (FSDP2 over the ranks)
and torchtitan's AdamW, checkpointed by torchtitan's CheckpointManager as
its trainer calls it (save() is the stall, maybe_wait_for_saving() until
durable):

    titan async         async_mode="async": DCP's thread-based async_save to
                        files (DCP's default stager copies in memory)
    titan pinned        async_mode="async_with_pinned_mem" (pinned memory,
                        DCP's checkpoint process): needs an accelerator,
                        reported as not run on a machine without one
    ckptd.titan async   ckptd.torchtitan.CheckpointManager, async_mode="async"

Per method, run REPEAT times (each rank's median counts, then the slowest
rank's): the trainer's blocking time (async_save or save returning), the
time until durable (the future's result; for dcp.save the same), and the
bytes it wrote. Then dcp.load of the saved
checkpoints by WORLD, WORLD/2 and 1 processes (resharding), FileSystemReader
against ckptd.dcp.Reader, the latter from storage (a daemon started after
the saves, whose memory holds none of them: its chunks come from the page
cache, as DCP's files do) and from the hot tier (the daemon that saved,
with --hot-bytes). Prints a table of ratios to the memcpy (saves) and to
dcp.load (loads). Absolute numbers on a shared machine are noise.
--loads-only saves once each way (what the loads read) and times only the
loads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20
LAYERS = 8


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="model + AdamW state, all ranks")
    p.add_argument("--world", type=int, default=4, help="processes that save")
    p.add_argument(
        "--dir", default=str(REPO / ".bench" / "dcp"), help="folder on the disk to benchmark"
    )
    p.add_argument("--ckptd", default=None, help="a ckptd binary (default: go build one)")
    p.add_argument("--no-process", action="store_true", help="skip the process-based checkpointer")
    p.add_argument("--repeat", type=int, default=5, help="runs of each method (the median counts)")
    p.add_argument("--no-titan", action="store_true", help="skip torchtitan's checkpoint managers")
    p.add_argument("--loads-only", action="store_true", help="save once each way; time the loads")
    p.add_argument("--codec", default=None, help="the daemons' --codec (default: theirs, auto)")
    p.add_argument(
        "--load-worlds", default=None, help="processes that load, comma-separated (WORLD,WORLD/2,1)"
    )
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # mode rank world init out
    return p.parse_args()


# ---- one rank -----------------------------------------------------------


def state(world: int, size_mib: int) -> dict[str, Any]:
    """This rank's DTensor pieces of the model and its AdamW state (3 tensors a layer)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    # Global rows a multiple of 4, so that 4, 2 and 1 ranks hold equal pieces.
    rows = max(4, size_mib * MiB // 4 // 3 // LAYERS // 1024 // 4 * 4) // world  # per rank
    model, optim = {}, {}
    torch.manual_seed(mesh.get_rank())

    def piece() -> DTensor:
        # Every rank makes only its own rows: no full tensor in memory.
        return DTensor.from_local(torch.randn(rows, 1024), mesh, [Shard(0)], run_check=False)

    for i in range(LAYERS):
        name = f"layers.{i}.weight"
        model[name] = piece()
        optim[name] = {"exp_avg": piece(), "exp_avg_sq": piece(), "step": torch.tensor(2.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3}]}}


def local_bytes(sd: dict[str, Any]) -> int:
    """Bytes of this rank's pieces."""
    import torch
    from torch.distributed.tensor import DTensor

    n = 0
    stack: list[Any] = [sd]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, DTensor):
            n += x.to_local().nbytes
        elif isinstance(x, torch.Tensor):
            n += x.nbytes
    return n


def du(path: Path) -> int:
    """Bytes of the files under path."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(res: dict[str, Any], repeat: int, name: str, start: Any, finish: Any = None) -> None:
    """Run start (then finish) repeat times between barriers; res[name]: the medians."""
    import torch.distributed as dist

    runs: list[tuple[float, float]] = []
    for i in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        handle = start(i)
        t1 = time.perf_counter()
        if finish is not None:
            finish(handle)
        t2 = time.perf_counter()
        dist.barrier()
        runs.append((t1 - t0, t2 - t0))
    res[name] = {
        "block": statistics.median(b for b, _ in runs),
        "durable": statistics.median(d for _, d in runs),
    }


def worker(mode: str, rank: int, world: int, init: str, out: str) -> None:
    """One rank: time every method (mode save) or every load (mode load)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptd
    import ckptd.dcp

    cfg = json.loads(Path(out, "config.json").read_text())
    if mode == "titan":
        titan(rank, world, cfg, out)
        return
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    sd = state(world, cfg["size_mib"])
    disk = Path(cfg["dir"])
    res: dict[str, Any] = {"bytes": local_bytes(sd)}
    client = ckptd.Client(cfg["socket"])
    if mode == "prep":  # only what the loads read
        dcp.save(sd, checkpoint_id=str(disk / "dcp_sync0"))
        dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 200))
    elif mode == "save":
        time_saves(res, cfg, sd, client)
    else:
        cold = ckptd.Client(cfg["cold_socket"])
        readers = {
            "dcp load": lambda: dcp.FileSystemReader(str(disk / "dcp_sync0")),
            "ckptd.dcp load": lambda: ckptd.dcp.Reader(cold, cfg["load_step"]),
            "ckptd.dcp load hot": lambda: ckptd.dcp.Reader(client, cfg["load_step"]),
        }
        # One untimed load each first: ckptd writes with O_DIRECT, so its
        # objects are not in the page cache after a save as DCP's files are;
        # after this both read from the page cache, as the table says.
        for reader in readers.values():
            dist.barrier()
            dcp.load(sd, storage_reader=reader())
        # Interleaved, so that a machine whose load drifts weighs on each alike.
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in readers}
        for _ in range(cfg["repeat"]):
            for name, reader in readers.items():
                one: dict[str, Any] = {}
                timed(one, 1, name, lambda i, r=reader: dcp.load(sd, storage_reader=r()))
                runs[name].append(one[name])
        for name, rs in runs.items():
            res[name] = {k: statistics.median(r[k] for r in rs) for k in ("block", "durable")}
        cold.close()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        Path(out, f"{mode}-{world}.json").write_text(json.dumps(every))
    client.close()
    dist.destroy_process_group()


def time_saves(res: dict[str, Any], cfg: dict[str, Any], sd: dict[str, Any], client: Any) -> None:
    """One rank's part of every save method."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ckptd.dcp

    disk, repeat = Path(cfg["dir"]), cfg["repeat"]
    copies = {}

    def memcpy(i: int) -> None:
        copies.clear()
        for k, t in sd["model"].items():
            copies[k] = t.to_local().clone()
            for s in ("exp_avg", "exp_avg_sq"):
                copies[k + s] = sd["optim"]["state"][k][s].to_local().clone()

    timed(res, repeat, "memcpy", memcpy)
    copies.clear()
    timed(
        res,
        repeat,
        "dcp async",
        lambda i: dcp.async_save(sd, checkpoint_id=str(disk / f"dcp_async{i}")),
        lambda f: f.result(),
    )
    if not cfg["no_process"]:
        timed(
            res,
            repeat,
            "dcp async proc",
            lambda i: dcp.async_save(
                sd,
                checkpoint_id=str(disk / f"dcp_async_proc{i}"),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            ),
            lambda f: f.result(),
        )
    timed(
        res,
        repeat,
        "ckptd.dcp async",
        lambda i: dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, 100 + i)),
        lambda f: f.result(),
    )
    timed(res, repeat, "dcp save", lambda i: dcp.save(sd, checkpoint_id=str(disk / f"dcp_sync{i}")))
    timed(
        res,
        repeat,
        "ckptd.dcp save",
        lambda i: dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 200 + i)),
    )


def titan(rank: int, world: int, cfg: dict[str, Any], out: str) -> None:
    """One rank: torchtitan's CheckpointManager, its own and ckptd's, on the same model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    import ckptd.torchtitan

    dist.init_process_group("gloo", init_method=f"file://{out}/init-titan", rank=rank,
                            world_size=world)  # fmt: skip
    rows = max(4, cfg["size_mib"] * MiB // 4 // 3 // LAYERS // 1024 // 4 * 4)  # all ranks
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, rows, bias=False) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_cfg = default_adamw(lr=1e-3)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=100)
    optimizers.state_dict()  # makes AdamW's state (init_optim_state): 3 tensors a layer
    res: dict[str, Any] = {}
    managers = {
        "titan async": CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0,
                                                async_mode="async", folder="titan"),
        "ckptd.titan async": ckptd.torchtitan.CheckpointManager.Config(
            enable=True, interval=1, keep_latest_k=0, async_mode="async", job="bench-titan",
            socket=cfg["socket"]),
    }  # fmt: skip
    accelerated = torch.accelerator.is_available()
    if accelerated:
        managers["titan pinned"] = CheckpointManager.Config(
            enable=True, interval=1, keep_latest_k=0, async_mode="async_with_pinned_mem",
            folder="titan-pinned")  # fmt: skip
    for name, config in managers.items():
        manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                               lr_schedulers=schedulers, states={}, sd_adapter=None,
                               base_folder=cfg["dir"])  # fmt: skip
        runs = []
        for i in range(cfg["repeat"]):
            dist.barrier()
            t0 = time.perf_counter()
            manager.save(curr_step=i + 1)
            t1 = time.perf_counter()
            manager.maybe_wait_for_saving()
            dist.barrier()
            runs.append((t1 - t0, time.perf_counter() - t0))
        manager.close()
        res[name] = {
            "block": statistics.median(b for b, _ in runs),
            "durable": statistics.median(d for _, d in runs),
        }
    every: list[Any] = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        Path(out, f"titan-{world}.json").write_text(json.dumps(every))
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------


def launch(mode: str, world: int, out: Path) -> list[dict[str, Any]]:
    """Run world ranks of this script in mode; their results."""
    init = out / f"init-{mode}-{world}"
    # As torchrun sets them: one OpenMP thread a rank, and how many ranks
    # share the node (ckptd's copy threads take their share of the CPUs).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world)}
    env.pop("CKPTD_ATTEMPT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, str(r), str(world), str(init), str(out)],
            env=env,
        )
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            for q in procs:
                q.kill()
            sys.exit(f"{mode} at {world} ranks failed")
    result: list[dict[str, Any]] = json.loads((out / f"{mode}-{world}.json").read_text())
    return result


def worst(runs: list[dict[str, Any]], name: str, key: str) -> float:
    """The slowest rank's median of a method."""
    return max(r[name][key] for r in runs)


def save_table(
    saves: list[dict[str, Any]],
    written: dict[str, int],
    titan: list[dict[str, Any]] | str | None,
) -> list[str]:
    """The saves: slowest rank per method, ratios to memcpy.

    titan: torchtitan's rows per rank (merged into saves), or why there are none.
    """
    if isinstance(titan, list):
        saves = [{**s, **t} for s, t in zip(saves, titan, strict=True)]
    base = worst(saves, "memcpy", "block")
    total = sum(r["bytes"] for r in saves)
    lines = [
        f"state: {total / MiB:.0f} MiB over {len(saves)} ranks; memcpy of a rank's "
        f"bytes {base * 1e3:.0f} ms (slowest rank)",
        "",
        f"{'method':<18}{'blocking':>10}{'x memcpy':>10}{'durable':>10}{'x memcpy':>10}"
        f"{'written MiB':>13}",
    ]
    for name in ("memcpy", "dcp async", "dcp async proc", "ckptd.dcp async", "dcp save",
                 "ckptd.dcp save", "titan async", "titan pinned", "ckptd.titan async"):  # fmt: skip
        if name not in saves[0]:
            continue
        b, d = worst(saves, name, "block"), worst(saves, name, "durable")
        w = f"{written[name] / MiB:.0f}" if name in written else "-"
        lines.append(
            f"{name:<18}{b * 1e3:>8.0f}ms{b / base:>10.2f}{d * 1e3:>8.0f}ms{d / base:>10.2f}{w:>13}"
        )
    targets = (
        ("ckptd.dcp save blocking / memcpy", "ckptd.dcp save", "memcpy", "block"),
        ("ckptd.dcp async blocking / dcp async", "ckptd.dcp async", "dcp async", "block"),
        ("ckptd.dcp async durable / dcp async", "ckptd.dcp async", "dcp async", "durable"),
    )
    if "ckptd.titan async" in saves[0]:
        own = min(("titan async", "titan pinned"), key=lambda n: worst(saves, n, "block")
                  if n in saves[0] else float("inf"))  # fmt: skip
        targets += (
            (f"ckptd.titan async blocking / {own}", "ckptd.titan async", own, "block"),
            (f"ckptd.titan async durable / {own}", "ckptd.titan async", own, "durable"),
        )
    lines.append("")
    for label, name, ref, key in targets:
        lines.append(f"{label:<44}{worst(saves, name, key) / worst(saves, ref, key):>6.2f}")
    if isinstance(titan, str):
        lines.append(f"torchtitan: {titan}")
    elif "titan pinned" not in saves[0]:
        lines.append(
            "titan pinned not run: torchtitan's async_with_pinned_mem stages with DCP's "
            "DefaultStager, whose non-blocking copy needs an accelerator"
        )
    return lines


def load_table(loads: dict[int, Any]) -> list[str]:
    """The loads: slowest rank per reader, ratios to dcp.load at the same world size."""
    lines = [f"{'load':<26}{'time':>10}{'x dcp.load':>12}"]
    for world, runs in loads.items():
        ref = worst(runs, "dcp load", "durable")
        for name in ("dcp load", "ckptd.dcp load", "ckptd.dcp load hot"):
            t = worst(runs, name, "durable")
            lines.append(f"{f'{name} at {world}':<26}{t * 1e3:>8.0f}ms{t / ref:>12.2f}")
    lines.append(
        "ckptd.dcp load: a daemon that did not save the step (storage, page-cached); "
        "hot: the one that saved it (--hot-bytes)"
    )
    return lines


def run_saves(args: argparse.Namespace, out: Path, sock: str, disk: Path) -> list[str]:
    """Time the saves (and torchtitan's); their table."""
    import ckptd

    saves = launch("save", args.world, out)
    with ckptd.Client(sock) as c:
        stored = {s.step: s.stored_bytes for s in c.steps("bench")}
    written = {
        "dcp async": du(disk / "dcp_async0"),
        "dcp save": du(disk / "dcp_sync0"),
        "ckptd.dcp async": stored.get(100, 0),
        "ckptd.dcp save": stored.get(200, 0),
    }
    if not args.no_process:
        written["dcp async proc"] = du(disk / "dcp_async_proc0")
    titan: list[dict[str, Any]] | str | None = "skipped (--no-titan)"
    if not args.no_titan:
        try:
            import torchtitan  # noqa: F401
        except ImportError:
            titan = "not installed (pip install 'ckptd[torchtitan]')"
        else:
            titan = launch("titan", args.world, out)
    return save_table(saves, written, titan)


def main() -> None:
    """Build, serve, run the saves and the loads, print the table."""
    args = parse_args()
    if args.worker:
        mode, rank, world, init, out = args.worker
        worker(mode, int(rank), int(world), init, out)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _serve import serve

    import ckptd

    disk = Path(args.dir)
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True)
    out = Path(tempfile.mkdtemp(prefix="bench-dcp-"))
    binary = args.ckptd
    if binary is None:
        binary = str(out / "ckptd")
        subprocess.run(["go", "build", "-o", binary, "./cmd/ckptd"], cwd=REPO, check=True)
    staging = f"{args.size_mib * 3 // 2 + 64}MiB"
    hot = f"{args.size_mib * 2 + 256}MiB"  # the two newest steps (--hot-steps 2)
    store = disk / "ckptd"
    worlds = [args.world, max(1, args.world // 2), 1]
    if args.load_worlds:
        worlds = [int(w) for w in args.load_worlds.split(",")]
    worlds = list(dict.fromkeys(worlds))
    lines: list[str] = []
    daemon: tuple[str, ...] = ("--storage", str(store), "--staging-bytes", staging)
    if args.codec:
        daemon += ("--codec", args.codec)
    with serve(binary, "dcp", *daemon, "--hot-bytes", hot) as sock:
        repeat = max(1, args.repeat)
        cfg = {"size_mib": args.size_mib, "dir": str(disk), "socket": sock}
        cfg["no_process"], cfg["repeat"] = args.no_process, repeat
        (out / "config.json").write_text(json.dumps(cfg))
        if args.loads_only:
            launch("prep", args.world, out)
        else:
            lines += [*run_saves(args, out, sock, disk), ""]
        # The loads read the newest ckptd.dcp save, which the hot tier keeps.
        cfg["load_step"] = 200 if args.loads_only else 200 + repeat - 1
        with serve(binary, "dcp-cold", *daemon) as cold:
            cfg["cold_socket"] = cold
            (out / "config.json").write_text(json.dumps(cfg))
            loads = {w: launch("load", w, out) for w in worlds}
            with ckptd.Client(cold) as c:
                info = next(s for s in c.steps("bench") if s.step == cfg["load_step"])
    codec = args.codec or "the daemon's default"
    ratio = info.stored_bytes / info.bytes
    lines += load_table(loads)
    lines.append(f"the step loaded: --codec {codec}, stored at {ratio:.2f}x its bytes (decoded)")
    print("\n".join(lines))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
