"""The client's mapping of the daemon's shared-memory staging arena.

The arena is mapped once per client and kept: mapping per save would pay a
page fault per 4 KiB on every save, which is most of the cost of a copy into
cold memory. A region's pages are mapped in one call (MADV_POPULATE_READ:
as fast as MAP_POPULATE, and on shared memory the pages come writable;
the WRITE variant takes twice as long) the first time a lease hands them
out, 2 MiB at a time: faulting them one by one costs about eight times as
much, and mapping the whole arena up front (MAP_POPULATE) made a new
process's first save or load wait for all of it (25 ms per GiB) however
little it touched. A kernel without the call
(before Linux 5.14) gets MAP_POPULATE as before. With CUDA, the mapping is
registered once as pinned memory, so device-to-host copies into it are DMA.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import warnings

import numpy as np

from . import _trust
from ._errors import CkptdError

# cudaHostRegisterPortable: the memory counts as pinned in every CUDA
# context of the process, not only the current device's.
_CUDA_HOST_REGISTER_PORTABLE = 1

# madvise(2)'s MADV_POPULATE_READ (Linux 5.14; Python's mmap names no constant).
_MADV_POPULATE_READ = 22
# The span whose pages a region's first use maps at once.
_POPULATE_SPAN = 2 << 20

# A restore in place hands out the hot tier's file, mapped read-only:
# torch warns of tensors made on it, which ckptd only ever copies from.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=r"ckptd(\.|$)",
)


class Arena:
    """A MAP_SHARED view of the arena file: read-write, or read-only for the hot tier's.

    ``mem`` is the whole arena as a uint8 array; lease offsets index it.
    The daemon's hot tier file (restores in place) is mapped read-only
    (writable False): it holds the daemon's own copies, which no client
    may change.
    """

    def __init__(self, path: str, size: int, owner: int, writable: bool = True) -> None:
        """Map the arena at path, after checking it is owner's (the daemon's uid).

        Raises:
            UntrustedDaemonError: the file or its folder fails the checks
                of _trust.open_arena.
            OSError: the file cannot be opened.
        """
        if size <= 0:
            raise CkptdError(f"daemon reported an arena of {size} bytes at {path}")
        fd = _trust.open_arena(path, owner, writable)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                raise CkptdError(
                    f"arena {path} is {st.st_size} bytes but the daemon says {size} "
                    "(was the daemon restarted with another --staging-bytes?)"
                )
            self._mm = _map(fd, size, 0, writable)
            # None: populated whole at mapping; else which spans are mapped yet.
            self._mapped: bytearray | None = None
            if _can_populate(self._mm):
                self._mapped = bytearray(-(-size // _POPULATE_SPAN))
            elif writable:  # not the hot tier's file: mapping all of it would allocate its holes
                self._mm.close()
                self._mm = _map(fd, size, getattr(mmap, "MAP_POPULATE", 0), writable)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.writable = writable
        self.ident = (st.st_dev, st.st_ino)
        self.mem: np.ndarray = np.frombuffer(self._mm, dtype=np.uint8)
        self._pin_lock = threading.Lock()
        self._pinned: bool | None = None

    @property
    def mapping(self) -> mmap.mmap:
        """The mapping itself: slicing it copies straight into a bytes object."""
        return self._mm

    def is_current(self) -> bool:
        """Whether the file at path is still the one mapped.

        A daemon that restarts after a clean shutdown creates a new arena
        file; writing into the old mapping would lose the save silently.
        """
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def region(self, offset: int, length: int) -> np.ndarray:
        """The bytes of a lease, bounds-checked against the mapping."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CkptdError(
                f"daemon leased [{offset}, {offset + length}) of a {self.size}-byte arena; "
                "client and daemon disagree about the arena"
            )
        self._populate(offset, length)
        return self.mem[offset : offset + length]

    def _populate(self, offset: int, length: int) -> None:
        """Map the pages of [offset, offset+length) not mapped yet, in one call per run.

        Two threads may map the same span at once: harmless, the second
        call finds the pages there. A call that fails leaves the pages to
        be faulted in by the copy, as without it.
        """
        mapped = self._mapped
        if mapped is None or length == 0:
            return
        first, end = offset // _POPULATE_SPAN, (offset + length - 1) // _POPULATE_SPAN + 1
        i = mapped.find(0, first, end)  # in C: a region already mapped costs one scan
        while i != -1:
            j = mapped.find(1, i, end)
            j = end if j == -1 else j
            start, stop = i * _POPULATE_SPAN, min(j * _POPULATE_SPAN, self.size)
            with contextlib.suppress(OSError, ValueError):
                self._mm.madvise(_MADV_POPULATE_READ, start, stop - start)
            mapped[i:j] = b"\x01" * (j - i)
            i = mapped.find(0, j, end)

    def pin(self) -> bool:
        """Register the mapping with CUDA once; return whether it is pinned.

        Called only when a CUDA tensor is saved or loaded, so a process that
        never touches CUDA never creates a CUDA context, and the context is
        made on the device the trainer selected. Failure is not fatal: the
        copies then go through pageable memory, synchronously.
        """
        with self._pin_lock:
            if self._pinned is None and not self.writable:
                self._pinned = False  # CUDA registers writable memory only
            if self._pinned is None:
                self._pinned = _cuda_host_register(int(self.mem.ctypes.data), self.size)
            return self._pinned

    def close(self) -> None:
        """Unregister from CUDA and unmap. Safe to call twice."""
        with self._pin_lock:
            if self._pinned:
                _cuda_host_unregister(int(self.mem.ctypes.data))
            self._pinned = False
        if getattr(self, "mem", None) is None:
            return
        self.mem = None  # type: ignore[assignment]
        # BufferError: a view of the arena is still referenced somewhere;
        # the mapping then goes away with the last view.
        with contextlib.suppress(BufferError):
            self._mm.close()


def _map(fd: int, size: int, extra: int = 0, writable: bool = True) -> mmap.mmap:
    flags = mmap.MAP_SHARED | extra
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


def _can_populate(mm: mmap.mmap) -> bool:
    """Whether this kernel maps pages on MADV_POPULATE_READ (tried on the first page)."""
    try:
        mm.madvise(_MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _cuda_host_register(ptr: int, size: int) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE)
    except Exception as e:
        warnings.warn(
            f"ckptd: cannot register the arena with CUDA ({e}); "
            "device copies will not be asynchronous",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    if int(err) != 0:
        _clear_cuda_error()
        warnings.warn(
            f"ckptd: cudaHostRegister of the {size}-byte arena failed (cudaError {int(err)}); "
            "device copies will be staged through pageable memory",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _cuda_host_unregister(ptr: int) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.cuda.synchronize()
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _clear_cuda_error()
    except Exception:
        pass


def _clear_cuda_error() -> None:
    """Reset CUDA's per-thread last error after a failed runtime call.

    torch's kernel-launch checks read cudaGetLastError, so a failure left
    behind here would surface later as a confusing error in an unrelated
    kernel. torch does not expose cudaGetLastError; call the loaded cudart.
    """
    try:
        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if "libcudart" in ln and "/" in ln}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, AttributeError):
        pass
