"""Benchmark: samples delivered by ckptd's prefetching dataset cache, from Python.

Writes WebDataset shards (~100 KiB samples, like ImageNet JPEGs, plus a
class label) into --dir, builds ckptd, and measures on the same shards and
the same storage:

    backend raw read     every shard file read once, sequentially, one
                         thread, with the files evicted from the page cache
                         first (posix_fadvise DONTNEED): the disk's bandwidth
    DataLoader + wds     torch DataLoader(num_workers=2) over the webdataset
                         library's WebDataset(...).shuffle(1000).batched(B),
                         from the evicted files, and again with the files
                         in the page cache
    ckptd epoch 0        Client.dataset (copy=True, prefetch=2) through a
                         freshly started `ckptd serve`, files evicted: all
                         from storage
    ckptd epoch 1        the next epoch, served from the daemon's cache
    ckptd epoch 0, S3    epoch 0 with the same shards in a MinIO on
                         loopback (scripts/minio.sh), through a fresh daemon
                         once it took its cache's memory (it does at start,
                         in the background: the time and CPU are printed);
                         then epochs 0 and 1 with a cache a quarter of the
                         dataset, the case S3 is read for

each first as fast as the consumer can take batches (delivered samples/s),
then with a consumer that simulates a training step -- a sleep per batch
(a GPU step leaves the CPU and the GIL free) sized so that the consumer
needs 0.9x the backend's raw bandwidth, measured again just before each
run (the disk of a shared machine changes speed from minute to minute)
-- reporting the stall fraction:
the share of the consumer's wall time lost to the loader (one minus the
ideal time, batches x the sleep's own duration, over the time taken: waits
in next(), GIL contention, freeing batches; in next() alone is shown too). The first
batch's wait (the daemon fills its 1000-sample shuffle window, then its
ring, before the first batch; webdataset starts workers) is shown apart: it
is paid once per epoch, and over a real epoch of hours it vanishes. (This
epoch lasts about 0.4 s, so its first tenth, before the read-ahead has
built any lead, weighs in the stall far more than in a real one.)

Then the CPU seconds per GB delivered, of the loader's processes (ckptd's
daemon, DataLoader's workers) and of the consumer's own (ckptd's prefetch
thread and its copies), against reading the files into one buffer: on a
node with few spare cores, what the loader takes from the trainer; and
epoch 0's from S3 over epoch 0's from the local disk (MinIO's own CPU is
not counted: it stands for a remote store). Then
the time to the first batch after a trainer restart (a new
connection resumes epoch 1 halfway, the daemon's cache warm), and, with a
cache smaller than the dataset (1.5x, 2x, 4x), the shard hit rate per
epoch and the bytes read from storage per epoch, for the node reading the
whole dataset and for one node of a two-node job (rank 0 of 2: another
half each epoch), with the lookahead and with the policy it replaced
(keep what the cache holds: `serve --cache-lookahead=false`).

The stall is measured again, at the same demand, with the trainer pinned
to CPU 0 and the loader (the daemon's threads, DataLoader's workers) to
the others, and with a busy loop on every CPU: a figure that holds on a
busy node, or shows what it costs there.

Targets: stall <= 1% at 0.9x the backend's bandwidth, >= 1.5x the
samples/s of DataLoader + webdataset, first batch after a restart <= 1 s,
and the lookahead reading no more than keeping what is held. Absolute numbers on a
shared 2-core machine are noisy; the median of --runs is reported.
`make bench-python` runs it (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _serve import cpu_seconds, pid_of, serve, wait_log

import ckptd

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20
GiB = 1 << 30


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=32, help="WebDataset shards")
    p.add_argument("--per-shard", type=int, default=160, help="samples per shard")
    p.add_argument("--sample-kib", type=int, default=100, help="bytes of each sample's jpg")
    p.add_argument("--batch", type=int, default=128, help="samples per batch")
    p.add_argument("--demand", type=float, default=0.9, help="consumer need / backend bandwidth")
    p.add_argument("--runs", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument(
        "--dir", default=str(REPO / ".bench" / "dataset"), help="folder on the disk to benchmark"
    )
    p.add_argument("--ckptd", default=None, help="a ckptd binary (default: go build one)")
    return p.parse_args()


# ---- the data ------------------------------------------------------------------


def write_shards(folder: Path, shards: int, per: int, size: int) -> list[Path]:
    """WebDataset shards of per samples (random jpg bytes, a cls label), fsynced."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for s in range(shards):
        path = folder / f"train-{s:05d}.tar"
        with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w") as tf:
            for i in range(per):
                key = f"{s:05d}/{i:06d}"
                jpg = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                for ext, data in (("jpg", jpg), ("cls", str(i % 1000).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
            tf.close()
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache, so reads go to the disk.

    Only these files, and without root: their pages are clean (fsynced).
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def self_cpu() -> float:
    """CPU seconds this process has used (every thread, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended (DataLoader workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def raw_read(paths: list[Path]) -> float:
    """Seconds to read every file once, sequentially, into one reused buffer."""
    buf = bytearray(16 * MiB)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


# ---- consumers -------------------------------------------------------------------


@dataclass
class Run:
    """One pass of a consumer over an epoch."""

    samples: int
    batches: int
    seconds: float  # wall time, first request to last batch
    waited: float  # time spent in next(), first batch included
    first: float  # the first batch's wait
    step: float = 0.0  # what one training step (a sleep) takes with no loader running
    cpu_loader: float = 0.0  # CPU seconds of the loader's own processes (daemon, workers)
    cpu_trainer: float = 0.0  # CPU seconds of the consumer's process (its threads)

    @property
    def rate(self) -> float:
        """Delivered samples per second."""
        return self.samples / self.seconds

    @property
    def stall(self) -> float:
        """Share of the wall time (after the first batch) not spent in training steps.

        Waiting in next() and anything else the loader costs the consumer
        (the GIL, freeing batches, a step slowed by the loader's threads):
        one minus the ideal time, batches x step, over the time it took.
        """
        busy = self.seconds - self.first
        return max(0.0, 1 - self.batches * self.step / busy) if busy > 0 else 0.0

    @property
    def in_next(self) -> float:
        """Share of the wall time (after the first batch) spent inside next()."""
        busy = self.seconds - self.first
        return (self.waited - self.first) / busy if busy > 0 else 0.0


def consume(batches: Iterable[list], step: float, nominal: float = 0.0) -> Run:
    """Take every batch, sleeping step seconds after each (the training step).

    nominal is what that sleep takes alone (calibrate_step): the ideal.
    """
    it = iter(batches)
    n = k = 0
    waited = first = 0.0
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)
        dt = time.perf_counter() - t0
        waited += dt
        if k == 0:
            first = dt
        if batch is None:
            break
        n += len(batch)
        k += 1
        if step:
            time.sleep(step)
    return Run(n, k, time.perf_counter() - t_start, waited, first, nominal)


def calibrate_step(step: float, n: int = 200) -> float:
    """What time.sleep(step) really takes here (timer slack included), with nothing else on."""
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(step)
    return (time.perf_counter() - t0) / n


def cold_raw(paths: list[Path], cpu: list[float] | None = None) -> float:
    """raw_read of the files evicted first: the disk's time (its CPU appended to cpu)."""
    evict(paths)
    c0 = self_cpu()
    t = raw_read(paths)
    if cpu is not None:
        cpu.append(self_cpu() - c0)
    return t


def wds_run(paths: list[Path], batch: int, step: float, nominal: float, warm: bool = False) -> Run:
    """One epoch of DataLoader + webdataset, from evicted files or the page cache.

    Its workers run on LOADER_CPUS when set (pinned()).
    """
    if warm:
        raw_read(paths)  # into the page cache
    else:
        evict(paths)
    w0, t0 = children_cpu(), self_cpu()
    r = consume(wds_loader(paths, batch), step, nominal)
    r.cpu_loader, r.cpu_trainer = children_cpu() - w0, self_cpu() - t0  # workers have ended
    return r


def wds_loader(paths: list[Path], batch: int) -> Iterable[list]:
    """Torch DataLoader(num_workers=2) over webdataset, batching in the workers."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    ds = (
        wds.WebDataset(
            [str(p) for p in paths],
            shardshuffle=False,  # one pass in file order; shuffled within 1000 below
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
        .shuffle(1000)
        .batched(batch, collation_fn=None)
    )
    return DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_pin_worker)


def _pin_worker(_: int) -> None:
    if LOADER_CPUS:
        os.sched_setaffinity(0, LOADER_CPUS)


# ---- conditions: pinned, and under a CPU hog ---------------------------------------

# The CPUs the loader's processes (ckptd's daemon, DataLoader's workers)
# run on while pinned() holds; empty: anywhere.
LOADER_CPUS: set[int] = set()


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid (a Go daemon runs many) to cpus."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """The consumer (the trainer) on CPU 0, the loader on the others.

    As a node that gives the data loader cores of its own does.
    """
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    os.sched_setaffinity(0, {cpus[0]})
    LOADER_CPUS.update(cpus[1:])
    try:
        yield
    finally:
        LOADER_CPUS.clear()
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def hogged() -> Iterator[None]:
    """A busy loop per CPU, at the benchmark's priority.

    As another job on a busy node would run.
    """
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def daemon(
    binary: str, work: Path, cache_bytes: int = 4 << 30, lookahead: bool = True
) -> contextlib.AbstractContextManager[str]:
    """A fresh `ckptd serve` (empty cache) with a temporary socket and arena."""
    store = str(work / "store")
    return serve(
        binary, "dsbench", "--storage", store, "--staging-bytes", "256MiB",
        "--cache-bytes", str(cache_bytes), "--dataset-allow", str(work),
        f"--cache-lookahead={str(lookahead).lower()}",
    )  # fmt: skip


EPOCHS = 4  # for the hit rates


def hit_rates(
    binary: str, work: Path, paths: list[Path], batch: int, cache: int, world: int, lookahead: bool
) -> tuple[list[float], list[int]]:
    """Shard hit rate and shards read from storage, epochs 0-3, of rank 0 of world.

    Through a daemon whose cache holds cache bytes and evicts by the
    lookahead or keeps what it holds. Rank 0 of 2 is one node of a two-node
    job: each epoch it reads another half of the dataset.
    """
    with daemon(binary, work, cache, lookahead) as sock, ckptd.Client(sock) as c:
        rates, misses = [], []
        for epoch in range(EPOCHS):
            spec = ckptd.DatasetSpec(  # off: padding would read shards the figures do not count
                paths[0].parent, batch_size=batch, epoch=epoch, rank=0, world_size=world, even="off"
            )
            with c.dataset(spec) as ds:
                for _ in ds:
                    pass
                st = ds.stats()
            rates.append(st.cache_hits / max(1, st.cache_hits + st.cache_misses))
            misses.append(st.cache_misses)
        return rates, misses


def ckptd_epochs(
    binary: str,
    work: Path,
    paths: list[Path],
    batch: int,
    step: float,
    nominal: float = 0.0,
    copy: bool = True,
) -> tuple[Run, Run, float]:
    """Epoch 0 from evicted files through a fresh daemon, then epoch 1 from its cache.

    Then a trainer restart: a new client (another connection, as a new
    process has) resumes epoch 1 halfway; its first batch's wait is the
    third value.
    """
    evict(paths)
    with daemon(binary, work) as sock:
        if LOADER_CPUS:
            pin_process(pid_of(sock), LOADER_CPUS)
        with ckptd.Client(sock) as c:
            runs = []
            for epoch in (0, 1):
                d0, t0 = cpu_seconds(pid_of(sock)), self_cpu()
                with c.dataset(
                    ckptd.DatasetSpec(paths[0].parent, batch_size=batch, epoch=epoch), copy=copy
                ) as ds:
                    r = consume(ds, step, nominal)
                    st = ds.stats()
                r.cpu_loader, r.cpu_trainer = cpu_seconds(pid_of(sock)) - d0, self_cpu() - t0
                runs.append(r)
                want = (len(paths), 0) if epoch == 0 else (0, len(paths))
                if (st.cache_misses, st.cache_hits) != want:
                    print(f"warning: epoch {epoch} cache misses/hits {st}", file=sys.stderr)
        half = runs[1].samples // 2
        with ckptd.Client(sock) as c:
            t0 = time.perf_counter()
            spec = ckptd.DatasetSpec(paths[0].parent, batch_size=batch, epoch=1, start=half)
            with c.dataset(spec, copy=copy) as ds:
                next(iter(ds))
                restart = time.perf_counter() - t0
        return runs[0], runs[1], restart


def s3_epochs(
    binary: str, work: Path, paths: list[Path], batch: int, runs: int
) -> dict[str, Run] | str:
    """Epochs with the same shards in a MinIO on loopback, through a fresh daemon each run.

    Epoch 0 with a cache larger than the dataset, then epochs 0 and 1 with
    one a quarter of it (the case S3 is read for: a dataset larger than a
    node's memory, whose evicted shards' buffers are used again); the
    median run of each by rate, or why there is none. The daemon's and the
    consumer's CPU are counted, as for a local epoch 0; MinIO's is not (it
    stands for a remote store).
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3util import REGION, MinIO, minio_binary

    found = minio_binary()
    if found is None:
        return "not run: MinIO is not installed (scripts/minio.sh installs it)"
    data = work / "minio"
    shutil.rmtree(data, ignore_errors=True)
    server = MinIO(found, data)
    try:
        server.make_bucket("data")
        for p in paths:
            server.put("data", f"ds/{p.name}", p.read_bytes())
        os.environ.update(AWS_ACCESS_KEY_ID=server.access_key,
                          AWS_SECRET_ACCESS_KEY=server.secret_key, AWS_REGION=REGION)  # fmt: skip

        def one(cache: int, epochs: int) -> list[Run]:
            flags = ["--storage", str(work / "store"), "--staging-bytes", "256MiB",
                     "--cache-bytes", str(cache), "--s3-endpoint", server.endpoint,
                     "--dataset-allow", "s3://data"]  # as daemon(), but for the source  # fmt: skip
            out = []
            with serve(binary, "dsbench-s3", *flags) as sock, ckptd.Client(sock) as c:
                # The daemon takes its cache's memory at start (serve
                # --cache-memory-at-start); a node's daemon starts before
                # its trainer's first epoch, so the epochs begin after it.
                d0 = cpu_seconds(pid_of(sock))
                took = wait_log(sock, "dataset shard memory taken")
                taken.append((taken_bytes(sock), took, cpu_seconds(pid_of(sock)) - d0))
                for epoch in range(epochs):
                    d0, t0 = cpu_seconds(pid_of(sock)), self_cpu()
                    spec = ckptd.DatasetSpec("s3://data/ds", batch_size=batch, epoch=epoch)
                    with c.dataset(spec) as ds:
                        r = consume(ds, 0.0)
                    r.cpu_loader, r.cpu_trainer = cpu_seconds(pid_of(sock)) - d0, self_cpu() - t0
                    out.append(r)
            return out

        taken: list[tuple[int, float, float]] = []  # cache bytes, seconds, CPU seconds
        quarter = max(sum(p.stat().st_size for p in paths) // 4, 1)
        small = [one(quarter, 2) for _ in range(runs)]
        big = median_run(lambda: one(4 << 30, 1)[0], runs)
        TAKEN[:] = taken
        return {
            "epoch 0": big,
            "epoch 0, cache 1/4": median_of([r[0] for r in small]),
            "epoch 1, cache 1/4": median_of([r[1] for r in small]),
        }
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def taken_bytes(sock: str) -> int:
    """The bytes of shard memory the daemon on sock logged it took at start.

    That is its cache's budget and a session's read-ahead budget beyond it.
    """
    log = (Path(sock).parent / "ckptd.log").read_text(errors="replace")
    line = next(x for x in log.splitlines() if "dataset shard memory taken" in x)
    return int(re.search(r"\bbytes=(\d+)", line).group(1))  # type: ignore[union-attr]


# What the S3 daemons took at start: bytes, seconds, CPU seconds.
TAKEN: list[tuple[int, float, float]] = []


def median_run(make: Callable[[], Run], runs: int) -> Run:
    """The run of median rate out of runs."""
    return median_of([make() for _ in range(runs)])


def median_of(runs: list[Run]) -> Run:
    """The run of median rate."""
    out = sorted(runs, key=lambda r: r.rate)
    return out[len(out) // 2]


# ---- main --------------------------------------------------------------------------


def build(binary: str | None, tmp: Path) -> str:
    """The ckptd binary: the one given, or built from the repository."""
    if binary:
        return binary
    out = tmp / "ckptd"
    subprocess.run(["go", "build", "-o", str(out), "./cmd/ckptd"], cwd=REPO, check=True)
    return str(out)


def main() -> int:
    """Run the benchmark and print the table."""
    args = parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-dsbench-bin-"))
    try:
        binary = build(args.ckptd, tmp)
        print(f"writing {args.shards} shards into {work}...", file=sys.stderr)
        paths = write_shards(work / "data", args.shards, args.per_shard, args.sample_kib << 10)
        return run(args, work, paths, binary)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, paths: list[Path], binary: str) -> int:
    """Measure everything and print the table; return the exit code."""
    total = sum(p.stat().st_size for p in paths)
    samples = args.shards * args.per_shard
    per_sample = total / samples

    raw_cpu: list[float] = []
    t_raw = statistics.median(cold_raw(paths, raw_cpu) for _ in range(args.runs))
    cpu_raw = statistics.median(raw_cpu)
    backend = total / t_raw  # bytes/s
    step = args.batch * per_sample / (args.demand * backend)

    def paced(demand: float) -> tuple[float, float]:
        """A training step needing demand x the backend as measured now, and its ideal.

        The disk of a shared machine changes speed from minute to minute,
        and its CPUs' wake-up latency with it: each run's step is sized
        from a read, and its ideal timed, just before it.
        """
        t = statistics.median(cold_raw(paths) for _ in range(2))
        st = args.batch * per_sample * t / (demand * total)
        return st, calibrate_step(st, 50)

    def stall_runs(demand: float, copy: bool = True) -> list[tuple[Run, Run, float]]:
        out = []
        for _ in range(args.runs):
            st, nom = paced(demand)
            out.append(ckptd_epochs(binary, work, paths, args.batch, st, nom, copy=copy))
        return out

    def median_by(runs: list[Run], key: Callable[[Run], float]) -> Run:
        return sorted(runs, key=key)[len(runs) // 2]

    print("DataLoader + webdataset...", file=sys.stderr)

    wds_max = median_run(lambda: wds_run(paths, args.batch, 0.0, 0.0), args.runs)
    wds_hot = median_run(lambda: wds_run(paths, args.batch, 0.0, 0.0, warm=True), args.runs)
    wds_step = wds_run(paths, args.batch, *paced(args.demand))

    print("ckptd...", file=sys.stderr)
    pairs = [ckptd_epochs(binary, work, paths, args.batch, 0.0) for _ in range(args.runs)]
    cold = median_by([p[0] for p in pairs], lambda r: r.rate)
    warm = median_by([p[1] for p in pairs], lambda r: r.rate)
    restart = statistics.median(p[2] for p in pairs)
    zc = ckptd_epochs(binary, work, paths, args.batch, 0.0, copy=False)[1]
    s3 = s3_epochs(binary, work, paths, args.batch, args.runs)
    stalls = stall_runs(args.demand)
    s_cold = median_by([p[0] for p in stalls], lambda r: r.stall)
    s_warm = median_by([p[1] for p in stalls], lambda r: r.stall)
    zstalls = stall_runs(args.demand, copy=False)
    z_cold = median_by([p[0] for p in zstalls], lambda r: r.stall)
    z_warm = median_by([p[1] for p in zstalls], lambda r: r.stall)
    sweep = {args.demand: (s_cold, [p[0].stall for p in stalls])}
    for demand in (0.5, 0.75):
        runs = [p[0] for p in stall_runs(demand)]
        sweep[demand] = (median_by(runs, lambda r: r.stall), [r.stall for r in runs])

    conditions = stalls_by_condition(
        lambda: stall_runs(args.demand),
        lambda: [wds_run(paths, args.batch, *paced(args.demand)) for _ in range(args.runs)],
    )

    print(
        f"\nckptd dataset: {args.shards} shards, {samples} samples of {per_sample / 1024:.0f} KiB "
        f"({total / MiB:.0f} MiB), batch {args.batch}, median of {args.runs}, on {work}\n"
    )
    throughput_table(per_sample, [
        ("backend raw read (evicted files, 1 thread)", samples / t_raw, ""),
        ("DataLoader(num_workers=2) + webdataset", wds_max.rate, "1.00x (baseline)"),
        ("DataLoader(num_workers=2) + webdataset, page cache warm", wds_hot.rate,
         _vs(wds_hot.rate, wds_max.rate, "")),
        ("ckptd epoch 0 (from storage), copy=True", cold.rate, _vs(cold.rate, wds_max.rate)),
        ("ckptd epoch 1 (from its cache), copy=True", warm.rate,
         _vs(warm.rate, wds_max.rate) + f"; {warm.rate / wds_hot.rate:.2f}x warm"),
        ("ckptd epoch 1 (from its cache), copy=False", zc.rate,
         _vs(zc.rate, wds_max.rate, "") + f"; {zc.rate / wds_hot.rate:.2f}x warm"),
        *([("ckptd epoch 0 from S3 (MinIO on loopback)", s3["epoch 0"].rate,
            _vs(s3["epoch 0"].rate, wds_max.rate, "")
            + f"; {s3['epoch 0'].rate / cold.rate:.2f}x local epoch 0")]
          if isinstance(s3, dict) else []),
    ])  # fmt: skip
    stall_table(args, step, per_sample, [s_cold, s_warm, z_cold, z_warm, wds_step], sweep)
    condition_table(conditions)
    cpu_table(total, cpu_raw, [
        ("DataLoader(num_workers=2) + webdataset", wds_max),
        ("ckptd epoch 0 (from storage), copy=True", cold),
        ("ckptd epoch 1 (from its cache), copy=True", warm),
        ("ckptd epoch 1 (from its cache), copy=False", zc),
        *([(f"ckptd {k} from S3 (MinIO), copy=True", r) for k, r in s3.items()]
          if isinstance(s3, dict) else []),
    ])  # fmt: skip
    s3_summary(s3, cold)
    ok = "met" if restart <= 1.0 else "NOT met"
    print(
        f"\ntime to the first batch after a trainer restart (a new connection resumes epoch 1 "
        f"halfway; the daemon's cache warm): {restart * 1e3:.0f} ms (target <= 1 s: {ok})"
    )
    hit_table(binary, work, paths, args.batch, total)
    return 0


def s3_summary(s3: dict[str, Run] | str, local: Run) -> None:
    """CPU per GB from S3 against a local epoch 0, or why it was not run."""
    if not isinstance(s3, dict):
        print(f"ckptd epoch 0 from S3: {s3}")
        return
    for nbytes, secs, cpu in sorted(TAKEN):
        per = cpu / (nbytes / 1e9)
        print(f"the S3 daemon took {nbytes / GiB:.2f} GiB of shard memory at start, before the "
              f"epochs: {secs:.2f} s, {cpu:.2f} CPU-s ({per:.2f} per GB)")  # fmt: skip
    base = local.cpu_loader + local.cpu_trainer
    for what, r in s3.items():
        ratio = (r.cpu_loader + r.cpu_trainer) / base
        met = "met" if ratio <= 1.2 else "NOT met"
        target = f" (target <= 1.2x: {met})" if what.startswith("epoch 0") else ""
        print(f"CPU per GB, {what} from S3 / epoch 0 from the local disk: {ratio:.2f}x{target}")


def throughput_table(per_sample: float, rows: list[tuple[str, float, str]]) -> None:
    """Samples/s of each loader taking batches as fast as it can."""
    print(f"{'throughput (consumer takes batches as fast as it can)':<58} {'samples/s':>10} "
          f"{'GB/s':>6}  ratio")  # fmt: skip
    for what, rate, ratio in rows:
        print(f"{what:<58} {rate:>10.0f} {rate * per_sample / 1e9:>6.2f}  {ratio}")


def cpu_table(total: int, raw: float, rows: list[tuple[str, Run]]) -> None:
    """CPU seconds per GB delivered, of the loader's processes and of the consumer's.

    On a node with few spare cores this is what the loader takes from the
    trainer; the baseline is reading the same files into one buffer.
    """
    per = 1e9 / total
    print(
        f"\nCPU seconds per GB delivered (user + system; the throughput runs above; "
        f"ckptd's daemon and DataLoader's workers / the consumer's own process):\n"
        f"{'loader':<48} {'loader':>7} {'consumer':>9} {'total':>7}  vs raw read"
    )
    print(f"{'backend raw read (evicted files, 1 thread)':<48} {'':>7} {'':>9} "
          f"{raw * per:>7.2f}  1.00x")  # fmt: skip
    for what, r in rows:
        both = (r.cpu_loader + r.cpu_trainer) * per
        print(f"{what:<48} {r.cpu_loader * per:>7.2f} {r.cpu_trainer * per:>9.2f} "
              f"{both:>7.2f}  {both / (raw * per):.2f}x")  # fmt: skip


def stall_table(
    args: argparse.Namespace,
    step: float,
    per_sample: float,
    runs: list[Run],
    sweep: dict[float, tuple[Run, list[float]]],
) -> None:
    """The stall figures: each consumer's median run, then epoch 0 by demand."""
    need = args.batch * per_sample / step
    print(
        f"\nstall with a training step (a sleep) sized so that the consumer needs "
        f"{args.demand:.2f}x the backend's bandwidth, measured again before each run "
        f"(first: {step * 1e3:.2f} ms per batch, {need / 1e9:.2f} GB/s). stall = time lost "
        "to the loader after the first batch, in next() or not\n"
    )
    print(f"{'consumer':<48} {'stall':>7} {'in next()':>10} {'1st batch':>10}  target")
    names = (
        "ckptd epoch 0 (from storage), copy=True",
        "ckptd epoch 1 (from its cache), copy=True",
        "ckptd epoch 0 (from storage), copy=False",
        "ckptd epoch 1 (from its cache), copy=False",
        "DataLoader(num_workers=2) + webdataset",
    )
    for what, r, target in zip(names, runs, ["<= 1%"] * 4 + [""], strict=True):
        ok = "" if not target else ("  met" if r.stall <= 0.01 else "  NOT met")
        print(
            f"{what:<48} {r.stall:>7.2%} {r.in_next:>10.2%} {r.first * 1e3:>8.0f}ms  {target}{ok}"
        )
    print("\nckptd epoch 0 (from storage), copy=True, by what the consumer needs (each run):")
    for demand, (r, all_runs) in sorted(sweep.items()):
        each = " ".join(f"{x:.2%}" for x in all_runs)
        stall, in_next = f"{r.stall:.2%}", f"{r.in_next:.2%}"
        print(f"  {demand:.2f}x the backend: stall {stall} ({each}), in next() {in_next}")


def stalls_by_condition(
    ckptd_runs: Callable[[], list[tuple[Run, Run, float]]], loader_runs: Callable[[], list[Run]]
) -> dict[str, tuple[Run, Run, Run]]:
    """Median stalls of ckptd's epochs 0 and 1 and of DataLoader, pinned and hogged."""
    out: dict[str, tuple[Run, Run, Run]] = {}
    if len(os.sched_getaffinity(0)) < 2:
        return out
    for name, cond in (("pinned: trainer on CPU 0, loader on the rest", pinned),
                       ("every CPU kept busy by another process", hogged)):  # fmt: skip
        print(f"ckptd and DataLoader, {name}...", file=sys.stderr)
        with cond():
            ck, dl = ckptd_runs(), loader_runs()
        cold, warm = (sorted((p[i] for p in ck), key=lambda r: r.stall) for i in (0, 1))
        dl.sort(key=lambda r: r.stall)
        out[name] = (cold[len(cold) // 2], warm[len(warm) // 2], dl[len(dl) // 2])
    return out


def condition_table(conditions: dict[str, tuple[Run, Run, Run]]) -> None:
    """The stall at the same demand on a node set up otherwise (median of the runs)."""
    if not conditions:
        print("\n(one CPU: no pinned or busy-node figures)")
        return
    print("\nstall at the same demand, the node set up otherwise:")
    print(f"  {'condition':<46} {'ckptd epoch 0':>14} {'ckptd epoch 1':>14} {'DataLoader':>11}")
    for name, (cold, warm, dl) in conditions.items():
        print(f"  {name:<46} {cold.stall:>14.2%} {warm.stall:>14.2%} {dl.stall:>11.2%}")


def hit_table(binary: str, work: Path, paths: list[Path], batch: int, total: int) -> None:
    """Hit rates and storage bytes per epoch, lookahead against keeping what is held."""
    shard = total / len(paths)
    print(
        "\nshard hit rate per epoch (epochs 0-3) with a cache smaller than the dataset, "
        "and MiB read from storage per epoch from epoch 1 on:"
    )
    print(f"  {'dataset':<8} {'the node reads':<20} {'lookahead':<18} {'keep what is held':<18} "
          f"{'MiB/epoch':>17}  {'ratio':>6}")  # fmt: skip
    for frac in (1.5, 2, 4):
        cache = int(total / frac)
        for world, who in ((1, "all of it"), (2, "half (1 node of 2)")):
            res = {
                la: hit_rates(binary, work, paths, batch, cache, world, la) for la in (True, False)
            }
            mib = {la: statistics.mean(m[1:]) * shard / MiB for la, (_, m) in res.items()}
            shown = {la: " ".join(f"{r:.0%}" for r in rates) for la, (rates, _) in res.items()}
            ratio = mib[True] / max(mib[False], 1e-9)
            print(
                f"  {frac:>4}x    {who:<20} {shown[True]:<18} {shown[False]:<18} "
                f"{mib[True]:>7.0f} vs {mib[False]:>5.0f}  {ratio:>5.2f}x"
            )
    print(
        "  (reading all of it once an epoch, nothing can hit more than what fits: both keep "
        "that; a node that reads another part each epoch gains from knowing the next one)"
    )


def _vs(rate: float, base: float, target: str = "  (target >= 1.5x)") -> str:
    return f"{rate / base:.2f}x DataLoader{target}"


if __name__ == "__main__":
    sys.exit(main())
