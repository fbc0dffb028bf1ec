"""Benchmark: the stall a trainer sees in ckptd.Client.save(), from Python.

Builds ckptd from the repository, starts `ckptd serve` on a temporary socket
with its storage on --dir, and times, on the same 1 GiB state (bf16-like
weights) in the same process:

    numpy copy       np.copyto of the same bytes into a warm MAP_SHARED
                     mapping of a /dev/shm file, on one thread
    numpy copy, N    the same, in 8 MiB pieces over N threads
                     (save()'s copy threads, CKPTD_COPY_THREADS): the floor
                     for any shared-memory hand-off on this machine
    save() stall     Client.save (begin, copy into the arena, commit) until
                     it returns, with the arena mapped and warm (the first
                     save, which maps it, is shown apart)
    torch.save       of the same state to a file on the same disk as ckptd's
                     storage, returning (page cache) and with fsync (durable,
                     which is what ckptd gives once the save is committed)
    checked copy     save() to a daemon started with --socket-group, which
                     shares its arena with a group and so has the client
                     hash what it copies (docs/security.md): its stall,
                     its drain and a load (which the client copies out and
                     checks), against the plain ones

and, loading the same state back into a module that holds it as buffers:

    load_state_dict  ckptd.torch.load_state_dict, which copies the saved
                     bytes straight into the module's tensors
    load + copy      Client.load into new tensors, then the module's
                     load_state_dict copying them in (a second copy of the
                     state, as ckptd.torch did before)
    torch.load       torch.load of the file above (page cache) + the
                     module's load_state_dict

and prints a table of ratios. Absolute numbers on a shared machine are
noise; the ratios are the point (target: save() stall <= 1.3x the numpy
copy on as many threads as save() copies with). `make bench` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _serve import serve

import ckptd
import ckptd.torch as ct
from ckptd import _copy

REPO = Path(__file__).resolve().parents[3]
GiB = 1 << 30
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB")
    p.add_argument("--tensors", type=int, default=64, help="tensors the state is cut into")
    p.add_argument("--runs", type=int, default=5, help="repetitions; the median is reported")
    p.add_argument(
        "--dir", default=str(REPO / ".bench" / "python"), help="folder on the disk to benchmark"
    )
    p.add_argument("--ckptd", default=None, help="a ckptd binary (default: go build one)")
    return p.parse_args()


def make_state(size: int, n: int) -> dict[str, torch.Tensor]:
    """bf16 weights of a plausible scale, as a model's state dict would hold."""
    g = torch.Generator().manual_seed(0)
    per = size // n // 2
    return {
        f"layers.{i}.weight": (torch.randn(per, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(n)
    }


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    """Wall time of each of runs calls of fn."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def warm_mapping(nbytes: int) -> Iterator[np.ndarray]:
    """A MAP_SHARED mapping of a /dev/shm file, as the client maps the arena.

    The caller warms it with a first copy, as the daemon pre-faults the arena.
    """
    fd, path = tempfile.mkstemp(prefix="ckptd-pybench-base-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        holder = [np.frombuffer(mm, np.uint8)]
        try:
            yield holder[0]
        finally:
            holder.clear()
            with contextlib.suppress(BufferError):  # a caller's view still alive
                mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def numpy_copy(arrays: list[np.ndarray], mem: np.ndarray) -> None:
    """Copy the arrays back to back into mem, as save() lays them out."""
    off = 0
    for a in arrays:
        n = a.nbytes
        np.copyto(mem[off : off + n].view(a.dtype), a.reshape(-1))
        off += n


def numpy_copy_threads(arrays: list[np.ndarray], mem: np.ndarray, pool: ThreadPoolExecutor) -> None:
    """numpy_copy with each array cut in 8 MiB pieces, copied by the pool's threads."""
    pieces, off = [], 0
    for a in arrays:
        flat, step = a.reshape(-1), (8 * MiB) // a.itemsize
        for i in range(0, flat.size, step):
            part = flat[i : i + step]
            pieces.append((mem[off : off + part.nbytes].view(a.dtype), part))
            off += part.nbytes
    list(pool.map(lambda p: np.copyto(*p), pieces))


def daemon(
    binary: str, storage: Path, staging: int, *extra: str, name: str = "pybench"
) -> contextlib.AbstractContextManager[str]:
    """A `ckptd serve` with a temporary socket and arena; yields the socket."""
    return serve(binary, name, "--storage", str(storage), "--staging-bytes", str(staging), *extra)


def build(binary: str | None, tmp: Path) -> str:
    """The ckptd binary: the one given, or built from the repository."""
    if binary:
        return binary
    out = tmp / "ckptd"
    subprocess.run(["go", "build", "-o", str(out), "./cmd/ckptd"], cwd=REPO, check=True)
    return str(out)


def as_module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding state's tensors as its buffers (state dict keys unchanged)."""
    module = torch.nn.Module()
    for k, v in state.items():
        module.register_buffer(k.replace(".", "_"), v)
    return module


def time_loads(
    c: ckptd.Client, state: dict[str, torch.Tensor], step: int, runs: int
) -> tuple[float, float]:
    """Median seconds of ckptd.torch's load into a module, and of load + copy."""
    ct.save_state_dict(c, step, as_module(state)).wait()
    target = as_module({k: torch.empty_like(v) for k, v in state.items()})

    def load_and_copy() -> None:
        target.load_state_dict(c.load(step, as_torch=True)["model"])

    into = statistics.median(timed(lambda: ct.load_state_dict(c, step, target), runs))
    two = statistics.median(timed(load_and_copy, runs))
    return into, two


def torch_save(state: dict[str, torch.Tensor], path: Path, fsync: bool) -> None:
    """torch.save to path, optionally made durable as ckptd's commit is."""
    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def main() -> int:
    """Run the benchmark and print the table."""
    args = parse_args()
    size = args.size_mib * MiB
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-bench-bin-"))
    storage = work / "store"
    shutil.rmtree(storage, ignore_errors=True)
    try:
        return run(args, size, work, storage, build(args.ckptd, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        (work / "torch.pt").unlink(missing_ok=True)


def run(args: argparse.Namespace, size: int, work: Path, storage: Path, binary: str) -> int:
    """Measure everything; return the exit code."""
    print(f"making a {size / GiB:.2f} GiB state of {args.tensors} bf16 tensors...", file=sys.stderr)
    state = make_state(size, args.tensors)
    arrays = [t.view(torch.int16).numpy() for t in state.values()]  # the same bytes, for numpy
    np_state = dict(zip(state, arrays, strict=True))
    nbytes = sum(a.nbytes for a in arrays)

    step = iter(range(1, 1_000_000))
    drains: list[float] = []

    def save(c: ckptd.Client, st: dict) -> float:
        t0 = time.perf_counter()
        h = c.save(next(step), st)
        stall = time.perf_counter() - t0
        h.wait()  # untimed: the drain runs in the daemon, not in the trainer
        drains.append(time.perf_counter() - t0 - stall)
        return stall

    # The machine is shared: each save is paired with a baseline copy taken
    # just before it, and the ratio is the median of the pairs' ratios.
    t_np: list[float] = []
    pairs: dict[str, list[tuple[float, float]]] = {"torch": [], "numpy": []}
    threads = _copy.threads()
    with (
        ThreadPoolExecutor(threads) as pool,
        warm_mapping(nbytes) as mem,
        daemon(binary, storage, nbytes + 256 * MiB) as sock,
        ckptd.Client(sock) as c,
    ):
        numpy_copy(arrays, mem)  # warm: fault every page in once
        t_first = save(c, state)
        for _ in range(args.runs):
            for kind, st in (("torch", state), ("numpy", np_state)):
                (base,) = timed(lambda: numpy_copy(arrays, mem), 1)
                t_np.append(base)
                pairs[kind].append((save(c, st), base))
        t_par = statistics.median(timed(lambda: numpy_copy_threads(arrays, mem, pool), args.runs))
        loads = time_loads(c, state, next(step), args.runs)
        plain_drains = list(drains)
        drains.clear()
        shared = ("--socket-group", str(os.getgid()))
        with (
            daemon(binary, storage / "sh", nbytes + 256 * MiB, *shared, name="pybench-sh") as sock2,
            ckptd.Client(sock2) as c2,
        ):
            save(c2, state)  # maps the arena
            drains.clear()
            for _ in range(args.runs):
                (base,) = timed(lambda: numpy_copy(arrays, mem), 1)
                pairs.setdefault("checked", []).append((save(c2, state), base))
            checked_drains = list(drains)
            checked_loads = time_loads(c2, state, next(step), args.runs)
    t_ts = statistics.median(timed(lambda: torch_save(state, work / "torch.pt", False), args.runs))
    t_tsf = statistics.median(timed(lambda: torch_save(state, work / "torch.pt", True), args.runs))
    target_module = as_module({k: torch.empty_like(v) for k, v in state.items()})
    t_tl = statistics.median(
        timed(
            lambda: target_module.load_state_dict(
                {k.replace(".", "_"): v for k, v in torch.load(work / "torch.pt").items()}
            ),
            args.runs,
        )
    )

    def stall(kind: str) -> tuple[float, float]:
        return (
            statistics.median(s for s, _ in pairs[kind]),
            statistics.median(s / b for s, b in pairs[kind]),
        )

    (t_torch, r_torch), (t_numpy, r_numpy) = stall("torch"), stall("numpy")
    t_checked, r_checked = stall("checked")
    d_plain, d_checked = statistics.median(plain_drains), statistics.median(checked_drains)
    base = statistics.median(t_np)
    target = f"  ({t_par / base:.2f}x on {threads} threads: target <= 1.30x that)"
    rows = [
        ("numpy copy into warm shm mapping", base, "1.00x (baseline)"),
        (f"numpy copy, {threads} threads", t_par, f"{t_par / base:.2f}x numpy copy"),
        ("save() stall, torch tensors", t_torch, f"{r_torch:.2f}x numpy copy{target}"),
        ("save() stall, numpy arrays", t_numpy, f"{r_numpy:.2f}x numpy copy{target}"),
        ("first save() stall (maps the arena)", t_first, f"{t_first / base:.2f}x numpy copy"),
        (
            "save() stall, checked copy",
            t_checked,
            f"{r_checked:.2f}x numpy copy, {t_checked / t_torch:.2f}x the plain save()",
        ),
        ("torch.save, same state, same disk", t_ts, f"{t_ts / t_torch:.1f}x the save() stall"),
        ("torch.save + fsync", t_tsf, f"{t_tsf / t_torch:.1f}x the save() stall"),
        ("save() returned -> committed (drain)", d_plain, "in the background"),
        ("  the same, checked copy", d_checked, f"{d_checked / d_plain:.2f}x the plain drain"),
        ("torch.load + load_state_dict", t_tl, "1.00x (load baseline)"),
        ("ckptd.torch.load_state_dict", loads[0], f"{loads[0] / t_tl:.2f}x torch.load"),
        ("Client.load + load_state_dict", loads[1], f"{loads[1] / t_tl:.2f}x torch.load"),
        (
            "  the same, checked copy",
            checked_loads[1],
            f"{checked_loads[1] / loads[1]:.2f}x the plain load",
        ),
    ]
    print(
        f"\nckptd Python client, {nbytes / GiB:.2f} GiB state ({args.tensors} bf16 tensors), "
        f"median of {args.runs}, storage on {work}\n"
    )
    print(f"{'what':<40} {'seconds':>9} {'GB/s':>7}  ratio")
    for what, t, ratio in rows:
        print(f"{what:<40} {t:>9.3f} {nbytes / t / 1e9:>7.2f}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
