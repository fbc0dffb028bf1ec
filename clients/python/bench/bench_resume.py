"""Benchmark: time to resume, from SIGKILL of every trainer to the restarted job's first step.

WORLD gloo processes (the trainers) hold the state of bench_dcp.py: Shard(0)
DTensor pieces of a model and its AdamW moments (float32, random), SIZE in
all. They save it as step 1 through one path, wait until it is durable
(and, for the memory tiers, kept in memory or on the peer), then idle as
a training job between checkpoints would. Then every trainer gets SIGKILL
(and, in the "daemon kill -9" rows, the node's ckptd too, which is started
again at once with the same arena and socket), a new job of WORLD
trainers starts, loads the step with dcp.load and takes a first training
step (an AdamW-like update of its weights from its moments, then an
all-reduce of the loss). The paths:

    dcp              DCP's FileSystemWriter/Reader on the local disk
    ckptd storage    ckptd.dcp through a daemon without memory tiers: the
                     restore reads the local disk (page-cached, as DCP's)
    ckptd hot        the daemon keeps the step in its hot tier (--hot-bytes):
                     a trainer restarted on the same node
    ckptd peer       two daemons on loopback (--peers, --peer-insecure); the
                     trainers' node is lost (its daemon killed with -9 and
                     its memory gone) and a replacement node's daemon, on
                     the lost node's address, restores from the peer that
                     holds the replicas

Each run is broken down, for the rank that took longest, into process
start (from the kill to the new trainer's state allocated: interpreter,
imports, process group), load (dcp.load, the client's first connection
and arena mapping included) and first step; "daemon" is when the
restarted daemon answered, from the kill. Ratios are against the dcp
row's, and the load against a memcpy of a rank's bytes measured in the
same run. Which tier served each ckptd load is read from the daemon's
ckptd_restores_total. Every resumed trainer checks its state against
what was saved (untimed). Absolute numbers on a shared machine are noise;
the files are in the page cache (nothing here drops it; ckptd's objects,
written with O_DIRECT, are read once before the kill to put them there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

T_MAIN = time.time()  # a resumed trainer's first moment, before its imports

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20
JOB = "resume"


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256, help="model + AdamW state, all ranks")
    p.add_argument("--world", type=int, default=4, help="trainer processes")
    p.add_argument("--repeat", type=int, default=1, help="runs of each path (the median counts)")
    p.add_argument(
        "--dir", default=str(REPO / ".bench" / "resume"), help="folder on the disk to benchmark"
    )
    p.add_argument("--ckptd", default=None, help="a ckptd binary (default: go build one)")
    p.add_argument("--only", default="", help="paths to run, comma-separated (default: all)")
    p.add_argument("--codec", default=None, help="the daemons' --codec (default: theirs, auto)")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # mode rank config
    return p.parse_args()


# ---- one trainer ----------------------------------------------------------


def local_pieces(sd: dict[str, Any]) -> dict[str, Any]:
    """This rank's local tensors of the state, by a flat name."""
    out = {}
    for k, w in sd["model"].items():
        out[k] = w.to_local()
        for s in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{s}"] = sd["optim"]["state"][k][s].to_local()
    return out


def empty_state(world: int, size_mib: int) -> dict[str, Any]:
    """The state's layout, zeroed: what a restarted trainer loads into."""
    import bench_dcp
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(4, size_mib * MiB // 4 // 3 // bench_dcp.LAYERS // 1024 // 4 * 4) // world

    def piece() -> DTensor:  # touched, as a model's initialisation would
        local = torch.empty(rows, 1024).fill_(0.0)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model, optim = {}, {}
    for i in range(bench_dcp.LAYERS):
        name = f"layers.{i}.weight"
        model[name] = piece()
        optim[name] = {"exp_avg": piece(), "exp_avg_sq": piece(), "step": torch.tensor(0.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 0.0}]}}


def crcs(sd: dict[str, Any]) -> dict[str, int]:
    """A CRC of each local piece's bytes."""
    return {k: zlib.crc32(t.numpy().tobytes()) for k, t in local_pieces(sd).items()}


def first_step(sd: dict[str, Any]) -> None:
    """One AdamW-like update of the weights from the moments, then the loss's all-reduce."""
    import torch
    import torch.distributed as dist

    loss = torch.zeros(())
    for k, w in sd["model"].items():
        st = sd["optim"]["state"][k]
        m, v, local = st["exp_avg"].to_local(), st["exp_avg_sq"].to_local(), w.to_local()
        local.addcdiv_(m, v.abs().sqrt().add_(1e-8), value=-1e-3)
        loss += local[0, 0]
    dist.all_reduce(loss)


def worker(mode: str, rank: int, config: str) -> None:
    """One trainer: save the step and idle (mode first), or resume from it (mode resume)."""
    import bench_dcp
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptd
    import ckptd.dcp

    cfg = json.loads(Path(config).read_text())
    world, out = cfg["world"], Path(cfg["out"])
    dist.init_process_group(
        "gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world
    )
    client = ckptd.Client(cfg["socket"]) if cfg["path"] != "dcp" else None
    if mode == "first":
        sd = bench_dcp.state(world, cfg["size_mib"])
        t = time.perf_counter()
        copies = {k: v.clone() for k, v in local_pieces(sd).items()}
        memcpy = time.perf_counter() - t
        del copies
        if client is None:
            dcp.save(sd, checkpoint_id=cfg["dcp_dir"])
        else:  # returns once the step is committed
            dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, 1, job=JOB))
        got = {"crc": crcs(sd), "memcpy": memcpy, "bytes": bench_dcp.local_bytes(sd)}
        (out / f"saved-{rank}.json").write_text(json.dumps(got))
        while True:  # training on, until killed
            time.sleep(3600)
    sd = empty_state(world, cfg["size_mib"])
    t_ready = time.time()
    if client is None:
        dcp.load(sd, checkpoint_id=cfg["dcp_dir"])
    else:
        dcp.load(sd, storage_reader=ckptd.dcp.Reader(client, 1, job=JOB))
    t_loaded = time.time()
    saved = json.loads((out / f"saved-{rank}.json").read_text())
    wrong = [k for k, c in crcs(sd).items() if saved["crc"][k] != c]
    if wrong:
        sys.exit(f"rank {rank}: {wrong} differ from what was saved")
    t_step0 = time.time()
    first_step(sd)
    t_step = time.time()
    times = {"main": T_MAIN, "ready": t_ready, "load": t_loaded - t_ready, "step": t_step - t_step0}
    (out / f"resumed-{rank}.json").write_text(json.dumps(times))
    if client is not None:
        client.close()
    dist.destroy_process_group()


# ---- the driver -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """A `ckptd serve` that can be killed with -9 and started again."""

    def __init__(self, binary: str, name: str, tmp: Path, *args: str) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.socket = str(self.dir / "ckptd.sock")
        self.arena = f"/dev/shm/ckptd-bench-resume-{os.getpid()}-{name}"
        self.metrics = f"127.0.0.1:{_free_port()}"
        self.cmd = [binary, "serve", "--socket", self.socket, "--job", JOB, "--metrics-addr",
                    self.metrics, "--log-level", "warn", *args]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, *, fresh_arena: bool = False) -> None:
        """Start (again); fresh_arena: on a new arena, the old one's memory gone."""
        if fresh_arena:
            shutil.rmtree(self.arena, ignore_errors=True)
        with open(self.dir / "ckptd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.cmd, "--arena-dir", self.arena], stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self) -> float:
        """Wait until the daemon answers; when it did (time.time())."""
        import ckptd

        deadline = time.monotonic() + 120
        while True:
            try:
                with ckptd.Client(self.socket, timeout=2, reconnect_timeout=0) as c:
                    c.steps(JOB)
                return time.time()
            except ckptd.DaemonUnavailableError:
                assert self.proc is not None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "ckptd.log").read_text(errors="replace")
                    sys.exit(f"ckptd serve did not start:\n{log}")
                time.sleep(0.02)

    def kill9(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (after a kill, nothing), and remove the arena."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.arena, ignore_errors=True)

    def metric(self, name: str) -> dict[str, float]:
        """A metric's samples, by their labels."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30) as r:
            text = r.read().decode()
        pat = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        return {m.group(1) or "": float(m.group(2)) for m in re.finditer(pat, text, re.M)}

    def hot_shards(self, binary: str) -> int:
        """The rank shards the daemon's hot tier holds (ckptd status)."""
        st = subprocess.run([binary, "status", "--socket", self.socket, "--json"],
                            capture_output=True, text=True, check=True)  # fmt: skip
        return int(json.loads(st.stdout).get("hot", {}).get("shards", 0))


@dataclass
class Way:
    """One way of checkpointing and resuming."""

    name: str
    kind: str  # dcp, storage, hot, peer
    kill_daemon: bool = False


PATHS = [
    Way("dcp (files)", "dcp"),
    Way("ckptd storage", "storage"),
    Way("ckptd storage, daemon kill -9", "storage", kill_daemon=True),
    Way("ckptd hot", "hot"),
    Way("ckptd hot, daemon kill -9", "hot", kill_daemon=True),
    Way("ckptd peer (node lost)", "peer", kill_daemon=True),
]


def spawn(mode: str, world: int, config: Path) -> list[subprocess.Popen[bytes]]:
    """Start world trainers of this script in mode."""
    # torchrun's OMP_NUM_THREADS and LOCAL_WORLD_SIZE (ckptd's copy threads
    # take the rank's share of the CPUs).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world)}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    env.pop("CKPTD_ATTEMPT", None)
    return [
        subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(config)], env=env)
        for r in range(world)
    ]


def wait_files(names: list[Path], procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """Wait until every file exists; exit if a process died first."""
    deadline = time.monotonic() + 1800
    while not all(n.exists() for n in names):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            sys.exit(f"{what} failed")
        time.sleep(0.05)


@contextlib.contextmanager
def daemons(
    binary: str, path: Way, tmp: Path, store: Path, args: argparse.Namespace
) -> Iterator[list[Daemon]]:
    """The daemons path needs: the trainers' node's first."""
    size_mib = args.size_mib
    staging = f"{size_mib * 3 // 2 + 64}MiB"
    common = ["--storage", str(store), "--staging-bytes", staging]
    if args.codec:
        common += ["--codec", args.codec]
    hot = ["--hot-bytes", f"{size_mib * 2 + 256}MiB"]
    started: list[Daemon] = []
    try:
        if path.kind == "storage":
            started.append(Daemon(binary, "node", tmp, *common))
        elif path.kind == "hot":
            started.append(Daemon(binary, "node", tmp, *common, *hot))
        elif path.kind == "peer":
            addrs = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
            for name, addr in zip(("node", "peer"), addrs, strict=True):
                peer = ["--peer-listen", addr, "--peers", ",".join(addrs), "--peer-insecure"]
                started.append(Daemon(binary, name, tmp, *common, *hot, *peer))
        for d in started:
            d.wait_ready()
        yield started
    finally:
        for d in started:
            d.stop()


def warm(folder: Path) -> None:
    """Read every file under folder, so that the page cache holds them.

    ckptd writes large objects with O_DIRECT, which leaves them out of the
    page cache, where DCP's buffered writes leave its files; read once,
    both restores read the page cache, as the table says.
    """
    for f in folder.rglob("*"):
        if f.is_file():
            with f.open("rb") as r:
                while r.read(16 << 20):
                    pass


def run(binary: str, path: Way, args: argparse.Namespace, tmp: Path, i: int) -> dict[str, Any]:
    """One checkpoint, kill and resume of path; its times (seconds) and the tier it used."""
    out = tmp / f"run-{path.kind}-{int(path.kill_daemon)}-{i}"
    out.mkdir()
    disk = Path(args.dir) / out.name
    disk.mkdir(parents=True)
    with daemons(binary, path, tmp / out.name, disk / "ckptd", args) as ds:
        cfg = {"world": args.world, "size_mib": args.size_mib, "out": str(out), "path": path.kind,
               "socket": ds[0].socket if ds else "",
               "dcp_dir": str(disk / "dcp" / "step-1")}  # fmt: skip
        config = out / "config.json"
        cfg["init"] = str(out / "init-first")
        config.write_text(json.dumps(cfg))
        first = spawn("first", args.world, config)
        wait_files([out / f"saved-{r}.json" for r in range(args.world)], first, "the first job")
        holder = ds[-1] if path.kind == "peer" else (ds[0] if path.kind == "hot" else None)
        deadline = time.monotonic() + 600
        while holder is not None and holder.hot_shards(binary) < args.world:
            if time.monotonic() > deadline:
                sys.exit(f"{path.name}: the step never reached the memory tier")
            time.sleep(0.05)
        if path.kind == "storage":
            warm(disk / "ckptd")
        cfg["init"] = str(out / "init-resume")
        config.write_text(json.dumps(cfg))
        t0 = time.time()
        for p in first:
            p.kill()
        if path.kill_daemon:
            ds[0].kill9()
        for p in first:
            p.wait()
        if path.kill_daemon:  # at once, as a supervisor would; a lost node's memory is gone
            ds[0].start(fresh_arena=path.kind == "peer")
        resumed = spawn("resume", args.world, config)
        up = ds[0].wait_ready() - t0 if path.kill_daemon else None
        for p in resumed:
            if p.wait() != 0:
                sys.exit(f"{path.name}: the resumed job failed")
        tiers = {}
        if ds:
            tiers = {re.sub(r'.*"(.*)".*', r"\1", k): v
                     for k, v in ds[0].metric("ckptd_restores_total").items() if v}  # fmt: skip
    saved = [json.loads((out / f"saved-{r}.json").read_text()) for r in range(args.world)]
    times = [json.loads((out / f"resumed-{r}.json").read_text()) for r in range(args.world)]
    ranks = [
        {"start": t["ready"] - t0, "load": t["load"], "step": t["step"]} for t in times
    ]  # fmt: skip
    slowest = max(ranks, key=lambda r: r["start"] + r["load"] + r["step"])
    shutil.rmtree(disk, ignore_errors=True)
    return {
        **slowest,
        "total": slowest["start"] + slowest["load"] + slowest["step"],
        "daemon": up,
        "tiers": tiers,
        "memcpy": max(s["memcpy"] for s in saved),
        "bytes": sum(s["bytes"] for s in saved),
    }


def table(results: dict[str, list[dict[str, Any]]], world: int, codec: str) -> str:
    """The report: medians of each path's runs, ratios to dcp's and to the memcpy."""

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    any_runs = next(iter(results.values()))
    memcpy = statistics.median(r["memcpy"] for rs in results.values() for r in rs)
    total = any_runs[0]["bytes"]
    lines = [
        f"time to resume: {world} ranks, {total / MiB:.0f} MiB of state "
        f"({total / world / MiB:.0f} MiB a rank), ckptd --codec {codec}; memcpy of a rank's "
        f"bytes {memcpy * 1e3:.0f} ms",
        "",
        f"{'path':<32}{'start':>8}{'load':>8}{'step':>8}{'total':>8}{'daemon':>8}"
        f"{'x dcp':>7}{'load x dcp':>12}{'load x memcpy':>15}  restored from",
    ]
    ref = "dcp (files)" if "dcp (files)" in results else None
    for name, runs in results.items():
        start, load, step, tot = (med(name, k) for k in ("start", "load", "step", "total"))
        ups = [r["daemon"] for r in runs if r["daemon"] is not None]
        up = f"{statistics.median(ups):>7.2f}s" if ups else f"{'-':>8}"
        x = f"{tot / med(ref, 'total'):>7.2f}" if ref else f"{'-':>7}"
        lx = f"{load / med(ref, 'load'):>12.2f}" if ref else f"{'-':>12}"
        tiers = ", ".join(sorted({t for r in runs for t in r["tiers"]})) or "files"
        lines.append(
            f"{name:<32}{start:>7.2f}s{load:>7.2f}s{step:>7.2f}s{tot:>7.2f}s{up}{x}{lx}"
            f"{load / memcpy:>15.1f}  {tiers}"
        )
    lines += [
        "",
        "start: from SIGKILL to the new trainer's state allocated (interpreter, imports, "
        "process group); load: dcp.load; step: the first training step; daemon: when the "
        "restarted daemon answered, from the kill. The slowest rank's; medians of the runs.",
    ]
    return "\n".join(lines)


def main() -> None:
    """Build, run every path, print the table."""
    args = parse_args()
    if args.worker:
        mode, rank, config = args.worker
        sys.path.insert(0, str(Path(__file__).parent))
        worker(mode, int(rank), config)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    shutil.rmtree(args.dir, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    binary = args.ckptd
    if binary is None:
        binary = str(tmp / "ckptd")
        subprocess.run(["go", "build", "-o", binary, "./cmd/ckptd"], cwd=REPO, check=True)
    only = {k for k in args.only.split(",") if k}
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for path in PATHS:
            if only and path.kind not in only:
                continue
            results[path.name] = [run(binary, path, args, tmp, i) for i in range(args.repeat)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    print(table(results, args.world, args.codec or "auto (the default)"))


if __name__ == "__main__":
    main()
