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
and ``"best"`` -- works unchanged. Sharded state (FSDP2, tensor
parallel): ``Trainer(strategy=ckptd.lightning.ModelParallelStrategy())``.
See docs/frameworks.md.
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
    from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
except ImportError as _err:  # pragma: no cover - depends on the environment
    from ._frameworks import missing

    raise missing("lightning", "lightning", _err) from None

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from . import _frameworks as fw
from . import torch as ct
from ._client import Client
from ._errors import AlreadyExistsError, CkptdError
from ._handle import SaveHandle

__all__ = ["CheckpointIO", "ModelParallelStrategy", "load_from_checkpoint", "read_pointer"]

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
    it. Sharded strategies bypass CheckpointIO: ModelParallelStrategy
    (FSDP2) has its ckptd subclass below; FSDP1's "sharded" state is not
    adapted (see docs/frameworks.md).
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
        self._save(checkpoint, path, rank=0, world_size=1)

    def _save(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        *,
        rank: int,
        world_size: int,
        optimizer: dict[str, Any] | None = None,
    ) -> None:
        """Stage rank's shard of checkpoint (rank 0 writes the pointer); see save_checkpoint.

        optimizer: an optimizer state to store as ckptd.torch's optimizer
        group (its DTensors laid out again on load) instead of in extra.
        """
        self._raise_failed()
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(
                f"a checkpoint to save through ckptd needs a global_step (got {step!r}): "
                "ckptd.lightning is for the Trainer's checkpoints"
            )
        target = _local(path)
        model_sd = checkpoint.get("state_dict", {})
        extra = fw.portable({k: v for k, v in checkpoint.items() if k != "state_dict"})
        attempt = self.client.attempt
        ident = fw.identity({"checkpoint": checkpoint, "optimizer": optimizer})
        if not fw.same_identity(self._saved.get(step), ident):
            try:
                if step in self._saved:
                    raise AlreadyExistsError(f"step {step} was saved by this run already")
                if self._resumed:
                    fw.settle_earlier_run(
                        self.client, step, rank=rank, job=self.job, timeout=self.wait_timeout
                    )
                h = ct.save_state_dict(
                    self.client, step, model_sd, optimizer=optimizer, extra=extra, rank=rank,
                    world_size=world_size, job=self.job,
                )  # fmt: skip
            except AlreadyExistsError as exists:
                attempt = self._same_as_stored(step, rank, model_sd, optimizer, extra, path, exists)
            else:
                with self._lock:
                    self._pending.append(h)
            self._saved[step] = ident
        if rank == 0:
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
        self,
        step: int,
        rank: int,
        model_sd: Any,
        optimizer: Any,
        extra: Any,
        path: Any,
        exists: AlreadyExistsError,
    ) -> str:
        """The attempt that stored step, once rank's tensors are these, bit for bit."""
        attempt = str(exists.metadata.get("attempt", "")) if exists.metadata else ""
        if not attempt and step in self._saved:
            attempt = self.client.attempt
        fw.wait_committed(
            self.client, step, job=self.job, attempt=attempt, timeout=self.wait_timeout, rank=rank
        )
        differs = fw.same_shard(
            self.client, step, rank=rank, job=self.job, model=model_sd, optimizer=optimizer,
            extra=extra,
        )  # fmt: skip
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


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2, tensor parallel) saving through ckptd.

    ``Trainer(strategy=ckptd.lightning.ModelParallelStrategy(job=...))``.
    With ``save_distributed_checkpoint=True`` (Lightning's default) the
    strategy saves sharded state through DCP into a folder, bypassing any
    CheckpointIO; this one stages every rank's pieces of the model and
    optimizer (DTensors, ckptd.torch's format) as its shard of the ckptd
    step at the global step, with no planning collective, and leaves
    CheckpointIO's pointer where Lightning expects the checkpoint. Loading
    lays the pieces out as the model is sharded now (another world size or
    mesh too). With ``save_distributed_checkpoint=False`` the full state
    goes through the Trainer's CheckpointIO (pass ckptd.lightning's as a
    plugin). One optimizer only.

    Args:
        *args: ModelParallelStrategy's.
        client: as CheckpointIO.
        socket: as CheckpointIO.
        job: as CheckpointIO.
        wait_timeout: as CheckpointIO.
        **kwargs: ModelParallelStrategy's.
    """

    def __init__(
        self,
        *args: Any,
        client: Client | None = None,
        socket: str | None = None,
        job: str | None = None,
        wait_timeout: float | None = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ckptd_io = CheckpointIO(client, socket=socket, job=job, wait_timeout=wait_timeout)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state: its DTensors themselves, with no copy to the CPU first."""
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        assert self.model is not None
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, its DTensors themselves."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Stage this rank's shard of the checkpoint's global step (every rank calls it)."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("ckptd.lightning.ModelParallelStrategy takes no storage_options")
        path = self.broadcast(filepath)
        rest = dict(checkpoint)
        optims = rest.pop("optimizer_states", [])
        if len(optims) > 1:
            raise NotImplementedError(
                "ckptd.lightning.ModelParallelStrategy saves one optimizer; "
                f"this module configures {len(optims)}"
            )
        self.ckptd_io._save(
            rest, path, rank=self.global_rank, world_size=self.world_size,
            optimizer=optims[0] if optims else None,
        )  # fmt: skip
        self.barrier("ckptd.lightning.ModelParallelStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load the step a pointer names into the sharded model and optimizer; return the rest.

        Any other path (Lightning's own folder or file) loads as Lightning loads it.
        """
        path = self.broadcast(checkpoint_path)
        pointer = read_pointer(path)
        if pointer is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        io = self.ckptd_io
        io._resumed = True
        step, job = int(pointer["step"]), pointer.get("job")
        fw.wait_committed(
            io.client, step, job=job, attempt=str(pointer.get("attempt") or ""),
            timeout=io.wait_timeout,
        )  # fmt: skip
        assert self.model is not None
        assert self.lightning_module is not None
        source = ct._Source(io.client, step, self.global_rank, job)
        skeleton = ct._skeleton(source.state)
        unpacker = ct._Unpacker(source.state, source)
        model_sd = unpacker.decode(skeleton["model"], get_model_state_dict(self.model))
        self.model.load_state_dict(model_sd, strict=self.lightning_module.strict_loading)
        fitting = self.lightning_module.trainer.state.fn == "fit"
        if fitting and self.optimizers and skeleton["optimizer"] is not None:
            opt = self.optimizers[0]
            like = get_optimizer_state_dict(self.model, opt)
            osd = unpacker.decode(skeleton["optimizer"], like)
            set_optimizer_state_dict(
                self.model, opt, optim_state_dict=osd, options=StateDictOptions(strict=True)
            )
        extra = unpacker.decode(pointer.get("extra") or skeleton["extra"])
        out: dict[str, Any] = fw.unportable(extra, weights_only is not True, str(path))
        return out

    def teardown(self) -> None:
        """Lightning's teardown, then wait for this run's saves to commit."""
        super().teardown()
        self.ckptd_io.teardown()


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
    """The ckptd pointer at path, or None for anything else (a torch.save'd file, a folder)."""
    target = _local(path)
    if target.is_dir():  # Lightning's own sharded checkpoint
        return None
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
