"""Lightning checkpoints through ckptd: ``Trainer(plugins=[ckptd.lightning.CheckpointIO()])``.

Every checkpoint Lightning saves (ModelCheckpoint's top-k and ``last``,
``trainer.save_checkpoint``) becomes the ckptd step of its global step:
the model's state dict as ``model:<name>`` tensors, everything else
(optimizer and scheduler states, loop and callback states,
hyper-parameters) as ckptd.torch's ``extra``. The save returns once the
state is copied into the daemon's shared memory; ckptd drains and commits
it in the background while training goes on.

Where Lightning expects the checkpoint file, a small JSON pointer is left
(the job, the step, and the non-tensor state of that very save), so that
ModelCheckpoint's bookkeeping -- ``last.ckpt``, top-k, ``ckpt_path="last"``
and ``"best"`` -- works unchanged. See docs/frameworks.md.
"""

from __future__ import annotations

import io as io_module
import json
import os
import threading
from pathlib import Path
from typing import Any, TypeVar

try:
    import lightning.fabric.plugins as _fabric_plugins
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchCheckpointIO
except ImportError as _err:  # pragma: no cover - depends on the environment
    from ._frameworks import missing

    raise missing("lightning", "lightning", _err) from None

import torch

from . import _frameworks as fw
from . import torch as ct
from ._client import Client
from ._errors import AlreadyExistsError, CkptdError
from ._handle import SaveHandle

__all__ = ["CheckpointIO", "load_from_checkpoint", "read_pointer"]

_T = TypeVar("_T")

POINTER = "ckptd.lightning"
POINTER_FORMAT = 1


class CheckpointIO(_fabric_plugins.CheckpointIO):
    """A Lightning CheckpointIO plugin that saves through a ckptd daemon.

    Args:
        client: the ckptd.Client to use (default: one of its own, made on the
            first save or load, on socket).
        socket: the daemon's socket when no client is given (default: as
            ckptd.Client: $CKPTD_SOCKET, else the daemon's default).
        job: the ckptd job (default: the daemon's).
        wait_timeout: seconds a load waits for the step a pointer names to
            commit (a save still draining), and teardown for this run's
            saves (None: no limit).

    Lightning calls save_checkpoint on global rank 0 only, with the whole
    state (single device, DDP, FSDP with ``state_dict_type="full"``), so
    each checkpoint is one shard: rank 0 of world size 1. Every rank loads
    it. Sharded strategies (FSDP's "sharded" state, ModelParallel) bypass
    CheckpointIO: use ckptd.dcp with them (see docs/frameworks.md).
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        socket: str | None = None,
        job: str | None = None,
        wait_timeout: float | None = 600.0,
    ) -> None:
        super().__init__()
        self._client = client
        self._own_client = client is None
        self._socket = socket
        self.job = job
        self.wait_timeout = wait_timeout
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        # global step -> what the tensors of the state saved at it were
        self._saved: dict[int, dict[str, Any]] = {}
        self._resumed = False  # loaded a step: an earlier run's last save may still drain

    @property
    def client(self) -> Client:
        """The ckptd client (made on first use when none was given)."""
        with self._lock:
            if self._client is None:
                self._client = Client(self._socket)
            return self._client

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage checkpoint as the ckptd step of its global step; leave a pointer at path.

        A second checkpoint at the same global step (ModelCheckpoint's
        top-k and ``last`` files, a callback saving again) shares the first
        one's tensors when they are the same -- unchanged since, or equal
        bit for bit to the committed step -- and has its own non-tensor
        state in its pointer. Tensors that differ at the same step raise
        CkptdError: ckptd keeps one state per step.

        Raises:
            TypeError: storage_options given (ckptd has none).
            ValueError: the checkpoint has no global_step.
            CkptdError: an earlier save of this run failed, or see above.
        """
        if storage_options is not None:
            raise TypeError(
                "ckptd.lightning.CheckpointIO takes no storage_options "
                f"(got {storage_options!r}); configure the daemon instead"
            )
        self._raise_failed()
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(
                f"a checkpoint to save through ckptd needs a global_step (got {step!r}): "
                "ckptd.lightning.CheckpointIO is for the Trainer's checkpoints"
            )
        target = _local(path)
        model_sd = checkpoint.get("state_dict", {})
        extra = fw.portable({k: v for k, v in checkpoint.items() if k != "state_dict"})
        attempt = self.client.attempt
        ident = fw.identity(checkpoint)
        if not fw.same_identity(self._saved.get(step), ident):
            try:
                if step in self._saved:
                    raise AlreadyExistsError(f"step {step} was saved by this run already")
                if self._resumed:
                    fw.settle_earlier_run(
                        self.client, step, rank=0, job=self.job, timeout=self.wait_timeout
                    )
                h = ct.save_state_dict(
                    self.client, step, model_sd, extra=extra, rank=0, world_size=1, job=self.job
                )
            except AlreadyExistsError as exists:
                attempt = self._same_as_stored(step, checkpoint, path, exists)
            else:
                with self._lock:
                    self._pending.append(h)
            self._saved[step] = ident
        fw.write_json(
            target,
            {
                POINTER: POINTER_FORMAT,
                "job": self.job,
                "step": step,
                "attempt": attempt,
                "extra": fw.extra_skeleton(extra),
            },
        )

    def _same_as_stored(
        self, step: int, checkpoint: dict[str, Any], path: Any, exists: AlreadyExistsError
    ) -> str:
        """The attempt that stored step, once its tensors are checkpoint's, bit for bit."""
        attempt = str(exists.metadata.get("attempt", "")) if exists.metadata else ""
        if not attempt and step in self._saved:
            attempt = self.client.attempt
        fw.wait_committed(
            self.client, step, job=self.job, attempt=attempt, timeout=self.wait_timeout
        )
        loaded = fw.load(self.client, step, job=self.job)
        now = fw.portable({k: v for k, v in checkpoint.items() if k != "state_dict"})
        stored = {"state_dict": loaded.model, "extra": loaded.extra["tensors"]}
        now = {"state_dict": checkpoint.get("state_dict", {}), "extra": now["tensors"]}
        differs = fw.same_tensors(stored, now)
        if differs is not None:
            raise CkptdError(
                f"{path}: a checkpoint at global step {step}, whose tensor {differs} differs "
                f"from the one ckptd stored at step {step}; ckptd keeps one state per step "
                "(a callback that changes weights without an optimizer step must save at "
                "another step)"
            ) from exists
        steps = {s.step: s.attempt for s in self.client.steps(self.job)}
        return steps.get(step, attempt)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint a pointer at path names, from ckptd (a plain Lightning file: torch.load).

        The step is waited for while it is still draining (a trainer
        killed after staging it). Values that were pickled are unpickled
        unless weights_only is True. map_location, a device or a str,
        places the model's tensors; the rest stays on the CPU, where
        Lightning's optimizers and RNG restores expect it.
        """
        pointer = read_pointer(path)
        if pointer is None:
            return _TorchCheckpointIO().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        step, job = int(pointer["step"]), pointer.get("job")
        self._resumed = True
        fw.wait_committed(
            self.client, step, job=job, attempt=str(pointer.get("attempt") or ""),
            timeout=self.wait_timeout,
        )  # fmt: skip
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        loaded = fw.load(
            self.client, step, job=job, extra_skeleton=pointer.get("extra"), device=device
        )
        out: dict[str, Any] = fw.unportable(loaded.extra, weights_only is not True, str(path))
        out["state_dict"] = loaded.model
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at path; the ckptd step stays (see docs/frameworks.md).

        ckptd's client cannot delete a stored step, so nothing here can drop
        the newest committed one: old steps go with ``ckptd prune
        --keep-last N`` on the daemon's store.
        """
        target = _local(path)
        if target.is_file() or target.is_symlink():
            target.unlink()

    def teardown(self) -> None:
        """Wait for this run's saves to commit; raise the first that failed."""
        with self._lock:
            pending, self._pending = self._pending, []
        for h in pending:
            h.wait(self.wait_timeout)
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None

    def _raise_failed(self) -> None:
        """Raise the error of an earlier save that failed; forget the committed ones."""
        with self._lock:
            done = [h for h in self._pending if h.done()]
            self._pending = [h for h in self._pending if not h.done()]
        for h in done:
            h.result()


def load_from_checkpoint(
    cls: type[_T],
    path: Any,
    *,
    client: Client | None = None,
    socket: str | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> _T:
    """``cls.load_from_checkpoint`` for a checkpoint saved through CheckpointIO.

    LightningModule.load_from_checkpoint reads the file itself, with
    torch.load, and never asks a Trainer's plugin; this loads the step the
    pointer at path names and hands it to Lightning's own loader, which
    builds the module from its hyper-parameters. kwargs go to it
    (map_location, strict, hparams_file, hyper-parameter overrides).
    """
    io = CheckpointIO(client, socket=socket)
    try:
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)
    finally:
        io.teardown()
    buf = io_module.BytesIO()
    torch.save(checkpoint, buf)
    buf.seek(0)
    loaded: _T = cls.load_from_checkpoint(buf, weights_only=weights_only, **kwargs)  # type: ignore[attr-defined]
    return loaded


def read_pointer(path: Any) -> dict[str, Any] | None:
    """The ckptd pointer at path, or None when path is another file (a torch.save'd one)."""
    target = _local(path)
    try:
        with open(target, "rb") as f:
            head = f.read(1)
            if head != b"{":
                return None
            obj = json.loads(head + f.read())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(obj, dict) or POINTER not in obj:
        return None
    if obj[POINTER] != POINTER_FORMAT:
        raise CkptdError(
            f"{path}: a ckptd.lightning pointer of format {obj[POINTER]!r}; this client reads "
            f"{POINTER_FORMAT}"
        )
    return obj


def _local(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in str(text):
        raise ValueError(
            f"{text}: ckptd.lightning.CheckpointIO keeps its pointers in a local (or mounted) "
            "folder; the checkpoint itself goes to the daemon's storage"
        )
    return Path(text)
