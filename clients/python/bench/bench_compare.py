"""Benchmark: ckptd's dataset path against Mosaic streaming and litdata.

The same samples (~100 KiB of bytes and a label each, as ImageNet JPEGs),
written by each library's own writer (Mosaic's MDSWriter; litdata's
optimize), read by one consumer with batches of --batch, as fast as it
takes them:

    Mosaic streaming   StreamingDataset + torch DataLoader(num_workers=2)
    litdata            StreamingDataset + StreamingDataLoader(num_workers=2)
    ckptd              Client.dataset over the MDS shards (ckptd reads
                       Mosaic's format as it is), through a fresh
                       `ckptd serve`

from the local disk (page cache evicted before epoch 0) and from a MinIO on
loopback (each library's S3 path; a fresh local cache for each), epoch 0
and epoch 1: samples per second delivered, and the CPU seconds per GB of
every process of the loader (DataLoader's workers, the daemon) and of the
consumer, MinIO's not counted (it stands for a remote store). Then, with
caches as cold again, an epoch 0 whose consumer trains for a fixed step
after each batch (a sleep: --demand samples per second, within what every
loader delivers): its stall is the share of the epoch, after the first
batch, not spent in steps, as bench_dataset.py counts it. Ratios are
against the best of the two others in the same run.

It runs in a virtualenv of its own (`make bench-compare` makes it under
.bench/): mosaicml-streaming pins numpy below 2.2 and transformers below 5,
which the project's own environment does not. A library that fails is
reported as such (with its error), not left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import ckptd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from _serve import cpu_seconds, pid_of, serve  # noqa: E402


@dataclass
class Run:
    """One epoch of one loader: samples, wall seconds, bytes, CPU seconds."""

    samples: int
    seconds: float
    nbytes: int
    cpu: float  # loader and consumer
    batches: int = 0
    first: float = 0.0  # the first batch's wait
    step: float = 0.0  # what one training step (a sleep) takes alone; 0: none

    @property
    def stall(self) -> float:
        """Share of the wall time after the first batch not spent in training steps."""
        busy = self.seconds - self.first
        return max(0.0, 1 - self.batches * self.step / busy) if busy > 0 else 0.0

    @property
    def rate(self) -> float:
        """Samples per second."""
        return self.samples / self.seconds

    @property
    def cpu_per_gb(self) -> float:
        """CPU seconds per GB delivered."""
        return self.cpu / (self.nbytes / 1e9)


def parse_args() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2600, help="samples (~100 KiB each)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dir", default=".bench", help="folder for the shards")
    p.add_argument("--ckptd", default=None, help="ckptd binary (default: build it)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a loader may take")
    p.add_argument(
        "--demand", type=float, default=1500, help="samples per second the paced consumer takes"
    )
    p.add_argument("--case", help=argparse.SUPPRESS)  # LOADER:local|S3, in a child
    p.add_argument("--write", help=argparse.SUPPRESS)  # mds|litdata, in a child
    p.add_argument("--work", help=argparse.SUPPRESS)
    return p.parse_args()


def sample(i: int) -> tuple[bytes, int]:
    """Sample i: 100 KiB of noise (a JPEG does not compress) and a label."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, 100 << 10, dtype=np.uint8).tobytes(), i % 1000


def write_mds(out: Path, n: int) -> None:
    """N samples as Mosaic MDS shards, by its MDSWriter."""
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"data": "bytes", "label": "int"}, size_limit="64mb") as w:
        for i in range(n):
            data, label = sample(i)
            w.write({"data": data, "label": label})


def _litdata_item(i: int) -> dict[str, object]:
    """Sample i as litdata.optimize takes it."""
    data, label = sample(i)
    return {"data": data, "label": label}


def write_litdata(out: Path, n: int) -> None:
    """N samples as litdata chunks, by its optimize."""
    import litdata

    litdata.optimize(
        fn=_litdata_item,
        inputs=list(range(n)),
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=2,
    )


def evict(folder: Path) -> None:
    """Drop folder's files from the page cache."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def consume(
    batches: Iterable[object],
    count: Callable[[object], int],
    extra_cpu: Callable[[], float],
    step: float = 0.0,
) -> Run:
    """Take every batch, sleeping step seconds after each (the training step).

    extra_cpu counts a process that is not our child (the daemon).
    """
    nominal = sleep_takes(step) if step else 0.0
    c0, e0, t0 = own_cpu(), extra_cpu(), time.perf_counter()
    n = k = 0
    first = 0.0
    for b in batches:
        if k == 0:
            first = time.perf_counter() - t0
        n += count(b)
        k += 1
        if step:
            time.sleep(step)
    seconds = time.perf_counter() - t0
    return Run(n, seconds, n * (100 << 10), own_cpu() - c0 + extra_cpu() - e0, k, first, nominal)


def sleep_takes(step: float, n: int = 100) -> float:
    """What time.sleep(step) really takes here, timer slack included: the ideal step."""
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(step)
    return (time.perf_counter() - t0) / n


def _count_dict(b: object) -> int:
    """Samples in a batch of dicts (Mosaic, litdata)."""
    return len(b["label"])  # type: ignore[index]


def mosaic(local: Path, remote: str | None, batch: int, step: float) -> list[Run]:
    """Two epochs of Mosaic streaming through a DataLoader (one, paced, with a step)."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    ds = StreamingDataset(local=str(local), remote=remote, shuffle=True, batch_size=batch)
    runs = []
    for _ in epochs(step):
        dl = DataLoader(ds, batch_size=batch, num_workers=2)
        runs.append(consume(dl, _count_dict, lambda: 0.0, step))
    return runs


def epochs(step: float) -> tuple[int, ...]:
    """The epochs a case reads: 0 and 1, or only 0 when paced."""
    return (0,) if step else (0, 1)


def lit(input_dir: str, cache: Path, batch: int, step: float) -> list[Run]:
    """Two epochs of litdata (one, paced, with a step)."""
    import litdata

    ds = litdata.StreamingDataset(input_dir, shuffle=True, cache_dir=str(cache))
    runs = []
    for _ in epochs(step):
        dl = litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=2)
        runs.append(consume(dl, _count_dict, lambda: 0.0, step))
    return runs


def ckptd_runs(binary: str, flags: list[str], source: str, batch: int, step: float) -> list[Run]:
    """Two epochs of Client.dataset through a fresh daemon (one, paced, with a step)."""
    with serve(binary, "cmpbench", *flags) as sock, ckptd.Client(sock) as c:
        pid = pid_of(sock)
        runs = []
        for epoch in epochs(step):
            spec = ckptd.DatasetSpec(source, batch_size=batch, epoch=epoch, format="mds")
            with c.dataset(spec) as ds:
                runs.append(consume(ds, len, lambda: cpu_seconds(pid), step))
        return runs


@contextlib.contextmanager
def minio(work: Path, folders: dict[str, Path]) -> Iterator[str]:
    """A MinIO on loopback holding folders under their prefixes of bucket "data"."""
    from s3util import REGION, MinIO, minio_binary

    found = minio_binary()
    if found is None:
        raise RuntimeError("MinIO is not installed (scripts/minio.sh installs it)")
    data = work / "minio"
    shutil.rmtree(data, ignore_errors=True)
    server = MinIO(found, data)
    try:
        server.make_bucket("data")
        for prefix, folder in folders.items():
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    server.put("data", f"{prefix}/{p.relative_to(folder)}", p.read_bytes())
        os.environ.update(
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_REGION=REGION,
            AWS_DEFAULT_REGION=REGION,
            AWS_ENDPOINT_URL=server.endpoint,
            S3_ENDPOINT_URL=server.endpoint,
        )
        yield server.endpoint
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def build(binary: str | None, tmp: Path) -> str:
    """The ckptd binary: binary, or one built into tmp."""
    if binary:
        return binary
    out = tmp / "ckptd"
    subprocess.run(["go", "build", "-o", str(out), "./cmd/ckptd"], cwd=HERE.parents[2], check=True)
    return str(out)


LOADERS = ("Mosaic streaming", "litdata", "ckptd")


def case(args: argparse.Namespace) -> list[Run]:
    """One loader from one source, in this (fresh) process."""
    import torch.multiprocessing

    # DataLoader workers hand tensors over by file descriptor by default;
    # litdata's, one per sample, exhaust the limit.
    torch.multiprocessing.set_sharing_strategy("file_system")
    name, where, *paced = args.case.split(":")
    # A paced case reads epoch 0 again, from caches of its own (cold).
    step, cold = (args.batch / args.demand, "-paced") if paced else (0.0, "")
    work = Path(args.work)
    mds, litd = work / "mds", work / "litdata"
    store = ["--storage", str(work / "store"), "--staging-bytes", "256MiB", "--cache-bytes", "4GiB"]
    if where == "local":
        evict(work)
        return {
            "Mosaic streaming": lambda: mosaic(mds, None, args.batch, step),
            "litdata": lambda: lit(str(litd), work / f"lit-cache-local{cold}", args.batch, step),
            "ckptd": lambda: ckptd_runs(
                args.ckptd, [*store, "--dataset-allow", str(work)], str(mds), args.batch, step
            ),
        }[name]()
    s3 = [*store, "--s3-endpoint", os.environ["AWS_ENDPOINT_URL"], "--dataset-allow", "s3://data"]
    return {
        "Mosaic streaming": lambda: mosaic(
            work / f"mosaic-cache{cold}", "s3://data/mds", args.batch, step
        ),
        "litdata": lambda: lit("s3://data/litdata", work / f"lit-cache-s3{cold}", args.batch, step),
        "ckptd": lambda: ckptd_runs(args.ckptd, s3, "s3://data/mds", args.batch, step),
    }[name]()


def in_child(
    args: argparse.Namespace, work: Path, what: list[str]
) -> subprocess.CompletedProcess[str]:
    """Run this script with what, in a process of its own.

    Each library sets process-wide state (litdata makes multiprocessing
    spawn), and the CPU of a child's workers is counted apart.
    """
    cmd = [sys.executable, __file__, "--work", str(work), "--batch", str(args.batch)]
    cmd += ["--demand", str(args.demand)]
    cmd += ["--ckptd", args.ckptd, *what]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # its loader workers too
            out, err = p.communicate()
            err += f"\ndid not finish in {args.timeout:.0f} s"
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def measured(args: argparse.Namespace, work: Path, name: str, where: str) -> list[Run] | str:
    """A case's runs, from a child process, or why there are none."""
    out = in_child(args, work, ["--case", f"{name}:{where}"])
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return [Run(**r) for r in json.loads(line[7:])]
    lines = [x for x in out.stderr.strip().splitlines() if x.strip() not in ("", "}", ")")]
    print(f"{name} from {where}:\n" + "\n".join(lines[-15:]), file=sys.stderr)
    return f"failed (exit {out.returncode}): {(lines or ['no output'])[-1][:150]}"


def main() -> int:
    """Run the benchmark, or (in a child) one case or one writer."""
    args = parse_args()
    if args.case:
        print("RESULT " + json.dumps([asdict(r) for r in case(args)]), flush=True)
        return 0
    if args.write:
        {"mds": write_mds, "litdata": write_litdata}[args.write](
            Path(args.work) / args.write, args.samples
        )
        return 0
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="compare-") as tmp:
        work = Path(tmp).resolve()
        args.ckptd = build(args.ckptd, work)
        return run(args, work)


def run(args: argparse.Namespace, work: Path) -> int:
    """Write both formats, measure every case, print the table."""
    for fmt in ("mds", "litdata"):
        out = in_child(args, work, ["--write", fmt, "--samples", str(args.samples)])
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
    gb = args.samples * (100 << 10) / 1e9
    print(f"{args.samples} samples of 100 KiB ({gb:.2f} GB), batch {args.batch}, 2 loader workers; "
          f"paced consumer {args.demand:.0f} samples/s")  # fmt: skip
    results: dict[tuple[str, str], list[Run] | str] = {}
    for name in LOADERS:
        results[(name, "local")] = measured(args, work, name, "local")
        results[(name, "local:paced")] = measured(args, work, name, "local:paced")
    try:
        with minio(work, {"mds": work / "mds", "litdata": work / "litdata"}):
            for name in LOADERS:
                results[(name, "S3")] = measured(args, work, name, "S3")
                results[(name, "S3:paced")] = measured(args, work, name, "S3:paced")
    except RuntimeError as e:
        for name in LOADERS:
            results[(name, "S3")] = results[(name, "S3:paced")] = f"not run: {e}"
    report(results)
    return 0


def report(results: dict[tuple[str, str], list[Run] | str]) -> None:
    """Print the table and ckptd's ratios."""
    print()
    head = ("epoch 0 /s", "epoch 1 /s", "CPU s/GB e0", "CPU s/GB e1", "stall e0")
    print(f"{'loader':<18}{'source':<7}" + "".join(f"{h:>13}" for h in head))
    for (name, where), r in results.items():
        if where.endswith(":paced"):
            continue
        if isinstance(r, str):
            print(f"{name:<18}{where:<7}  {r}")
            continue
        paced = results[(name, f"{where}:paced")]
        cells = (
            f"{r[0].rate:.0f}",
            f"{r[1].rate:.0f}",
            f"{r[0].cpu_per_gb:.2f}",
            f"{r[1].cpu_per_gb:.2f}",
            "failed" if isinstance(paced, str) else f"{paced[0].stall:.1%}",
        )
        print(f"{name:<18}{where:<7}" + "".join(f"{c:>13}" for c in cells))
    print()
    for where in ("local", "S3"):
        mine = results.get(("ckptd", where))
        others = [
            r
            for (n, w), r in results.items()
            if w == where and n != "ckptd" and not isinstance(r, str)
        ]
        if isinstance(mine, str) or mine is None or not others:
            continue
        for epoch in (0, 1):
            best = max(o[epoch].rate for o in others)
            cpu = min(o[epoch].cpu_per_gb for o in others)
            print(
                f"ckptd {where} epoch {epoch}: {mine[epoch].rate / best:.2f}x the samples/s "
                f"of the best other, {mine[epoch].cpu_per_gb / cpu:.2f}x the CPU per GB "
                "of the leanest"
            )


if __name__ == "__main__":
    sys.exit(main())
