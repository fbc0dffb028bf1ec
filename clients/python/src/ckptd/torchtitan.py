"""torchtitan checkpoints through ckptd: one line of the recipe config.

::

    from ckptd.torchtitan import CheckpointManager

    config = llama3_8b()  # a torchtitan 0.3 recipe (Trainer.Config)
    config.checkpoint = CheckpointManager.Config(interval=500, async_mode="async", job="llama3-8b")

CheckpointManager is torchtitan's own DCP CheckpointManager with the
storage swapped: the Trainer builds it from its nested Config and calls it
as ever (load at the start, save after each step, maybe_wait_for_staging
before the optimizer step), and every checkpoint is a ckptd step saved
through ckptd.dcp:

- ``async_mode="async"`` (and ``"async_with_pinned_mem"``, the same here)
  stages with ckptd.dcp.Writer's stage(): the trainer's stall is one copy
  into the daemon's shared-memory arena (locked pages; for CUDA tensors a
  device-to-host copy into it), with no collective; DCP's thread commits
  the step over the manager's gloo group. There is no stager or checkpoint
  process of DCP's own: the arena is the pinned host memory, and the
  daemon compresses and writes in the background. ``"disabled"``:
  dcp.save returns once the step is committed.
- Steps are ``ckptd://<job>/step-<N>`` (Config.job; "" for the daemon's
  --job). Config.folder is used only for a last save in Hugging Face
  format (``last_save_in_hf``), which is an export of files, not a step.
- load(step=-1) resumes from the job's newest committed step (rank 0's
  answer, broadcast, so every rank loads the same), load(step=N) from step
  N; with no committed step, ``initial_load_path`` as torchtitan takes it,
  which may also be a ckptd step of another job (``ckptd://<job>/step-N``
  or ``ckptd://<job>/latest``).
- ``keep_latest_k`` is applied only once a newer step is committed: rank
  0's thread waits for each save's commit, then runs ``ckptd prune
  --keep-last K`` on the daemon's store (Config.ckptd_bin; the store and
  job come from the daemon). A save that fails prunes nothing.
- A save of a step the job holds committed already (a rerun from an
  earlier step of the same job) raises AlreadyExistsError: ckptd never
  changes a committed step. Rewind by starting another job from the
  step: ``job="run-2", initial_load_path="ckptd://run-1/step-400",
  initial_load_model_only=False``.
"""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import _frameworks

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
    from torchtitan.components.checkpointer import dcp as _tt
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.tools import filesystem
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import GarbageCollection
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise _frameworks.missing("torchtitan", "torchtitan", _err) from _err

from . import dcp as cdcp
from ._client import Client
from ._errors import CkptdError
from .v1 import ckptd_pb2 as pb
from .v1 import ckptd_pb2_grpc as pb_grpc

__all__ = ["CheckpointManager"]

AsyncMode = _tt.AsyncMode


class CheckpointManager(_tt.CheckpointManager):  # type: ignore[misc]
    """torchtitan's CheckpointManager saving and loading ckptd steps (see the module)."""

    # torchtitan's attributes this class uses (its base is untyped).
    enable: bool
    folder: str
    pg: Any
    states: dict[str, Any]
    async_mode: Any
    keep_latest_k: int
    initial_load_path: str | None
    initial_load_in_hf: bool
    initial_load_model_only: bool
    last_save_in_hf: bool
    save_future: Future[Any] | None
    purge_queue: Any
    purge_thread: threading.Thread | None

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_tt.CheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint settings, and where the steps go."""

        job: str = ""
        """The ckptd job of the steps ("": the daemon's --job)."""

        socket: str | None = None
        """The daemon's socket (None: $CKPTD_SOCKET, else the default)."""

        commit_timeout: float | None = None
        """Seconds a save waits for its step to commit (None: no limit)."""

        ckptd_bin: str = "ckptd"
        """The ckptd command keep_latest_k runs (`ckptd prune`)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if not self.enable:
            return
        self.job = config.job
        self.ckptd_bin = config.ckptd_bin
        self.client = Client(config.socket)
        job = config.job or None
        self._writer = cdcp.Writer(self.client, job=job, timeout=config.commit_timeout)
        self._async_writer = cdcp.Writer(
            self.client, job=job, timeout=config.commit_timeout, process_group=self.pg
        )
        if self.purge_thread is not None:  # torchtitan's deletes folders: stop it
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = None
        self._prunes: queue.Queue[tuple[int, Future[Any] | None] | None] = queue.Queue()
        if self.keep_latest_k > 0 and _rank() == 0:
            self.purge_queue = self._prunes  # torchtitan's close() ends the thread
            self.purge_thread = threading.Thread(
                target=self._pruner, name="ckptd-keep-latest-k", daemon=True
            )
            self.purge_thread.start()
        logger.info(
            "Checkpoints are ckptd steps %s (daemon at %s)",
            self._create_checkpoint_id(0).replace("step-0", "step-<N>"),
            self.client.socket,
        )

    def _close(self) -> None:
        super()._close()
        self.client.close()

    # ---- where a step goes ----------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """The step's ckptd:// id (folder is torchtitan's, unused)."""
        return f"{cdcp.SCHEME}{self.job}/step-{step}"

    def _find_load_step(self, folder: str = "") -> int:
        """The job's newest committed step (rank 0's answer, on every rank), or -1."""
        steps = [s.step for s in self.client.steps(self.job or None)] if _rank() == 0 else []
        found = [max(steps) if steps else -1]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return int(found[0])

    # ---- saving ---------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: Any,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | None:
        """Save state_dict as the ckptd step checkpoint_id names (see the module).

        Returns DCP's future for an async mode (it completes once the step
        is committed), else None once the step is committed. to_hf: the
        files torchtitan exports, under Config.folder.
        """
        if to_hf:
            step = cdcp.parse_checkpoint_id(checkpoint_id).step
            folder = filesystem.join(self.folder, f"step-{step}")
            super().dcp_save(state_dict, folder, async_mode, enable_garbage_collection, True)
            return None
        ret: Future[Any] | None = None
        if async_mode == AsyncMode.DISABLED:
            state_dict_saver.save(
                state_dict, storage_writer=self._writer, checkpoint_id=checkpoint_id
            )
        else:
            started = state_dict_saver.async_save(
                state_dict,
                storage_writer=self._async_writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
            )
            # A Future: the Writer stages itself (AsyncSaveResponse comes of a stager's future).
            assert isinstance(started, Future)
            ret = started
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save curr_step if due: committed on return, or staged with save_future set."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # the last save committed, or its error raised here
        begin = time.monotonic()
        future: Future[Any] | None = None
        if last_step:
            self._save_last_step(curr_step)  # synchronous: committed when it returns
        else:
            if self.async_mode != AsyncMode.DISABLED:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            future = self.dcp_save(
                self._flattened_model_states_sd(),
                checkpoint_id=self._create_checkpoint_id(curr_step),
                async_mode=self.async_mode,
                enable_garbage_collection=self.async_mode == AsyncMode.DISABLED,
            )
            self.save_future = future
        if not (last_step and self.last_save_in_hf):  # an HF export is no step
            self._prune_once_committed(curr_step, future)
        logger.info(
            "%s step %d through ckptd in %.2f seconds.",
            "Staged" if future is not None else "Saved",
            curr_step,
            time.monotonic() - begin,
        )
        return True

    # ---- loading --------------------------------------------------------

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load a ckptd:// step into state_dict (other ids: torchtitan's files)."""
        if from_hf or not cdcp.Writer.validate_checkpoint_id(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        state_dict_loader.load(
            state_dict, storage_reader=cdcp.Reader(self.client), checkpoint_id=checkpoint_id
        )
        if MODEL in self.states:  # torchtitan flattens the model's states: load them back
            self.states[MODEL].load_state_dict(state_dict)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume from the job's newest committed step, or step; else the initial load."""
        if step != -1:
            self._check_committed(step)
            load_step = step
        else:
            load_step = self._find_load_step()
        if load_step == -1:
            path = self.initial_load_path
            if path and cdcp.Writer.validate_checkpoint_id(path):
                if self.initial_load_in_hf:
                    raise CkptdError(
                        f"checkpoint.initial_load_path {path!r} is a ckptd step, which holds "
                        "DCP's state, not Hugging Face safetensors: set initial_load_in_hf=False"
                    )
                return self._load_from(path, self.initial_load_model_only)
            # torchtitan's own initial load (files, Hugging Face assets), or a fresh start.
            return bool(self._initial_load_from_files())
        return self._load_from(self._create_checkpoint_id(load_step), model_only=load_step == 0)

    def _load_from(self, checkpoint_id: str, model_only: bool) -> bool:
        logger.info("Loading the checkpoint from %s.", checkpoint_id)
        begin = time.monotonic()
        states = self._states_to_load(model_only)
        self.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info("Finished loading the checkpoint in %.2f seconds.", time.monotonic() - begin)
        return True

    def _initial_load_from_files(self) -> bool:
        """Run torchtitan's load with its checkpoint folder out of the way: its initial load."""
        folder = self.folder
        self.folder = filesystem.join(self.folder, ".ckptd-steps-are-not-here")
        try:
            return bool(super()._load(-1))
        finally:
            self.folder = folder

    def _check_committed(self, step: int) -> None:
        steps = [s.step for s in self.client.steps(self.job or None)]
        if step not in steps:
            raise CkptdError(
                f"--checkpoint.load_step={step}: job {self.job or '(the daemon default)'} has "
                f"no committed step {step} (committed: {steps or 'none'})"
            )

    # ---- keep_latest_k --------------------------------------------------

    def _prune_once_committed(self, step: int, future: Future[Any] | None) -> None:
        if self.keep_latest_k > 0 and _rank() == 0:
            self._prunes.put((step, future))

    def _pruner(self) -> None:
        """Rank 0's thread: after each save commits, keep the newest keep_latest_k steps."""
        while (item := self._prunes.get()) is not None:
            step, future = item
            try:
                if future is not None:
                    future.result()
                self._prune(step)
            except Exception as e:  # a failed save or prune must not stop training
                logger.warning(
                    "keep_latest_k=%d not applied after step %d: %s", self.keep_latest_k, step, e
                )

    def _prune(self, step: int) -> None:
        committed = sorted(s.step for s in self.client.steps(self.job or None))
        if step not in committed:
            raise CkptdError(f"step {step} is not committed, so nothing older goes")
        if len(committed) <= self.keep_latest_k:
            return
        status = pb_grpc.DaemonStub(self.client._conn.channel).GetStatus(
            pb.GetStatusRequest(), timeout=self.client._conn.timeout
        )
        job = self.job or status.default_job
        argv = [self.ckptd_bin, "prune", "--storage", status.storage, "--job", job,
                "--keep-last", str(self.keep_latest_k)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CkptdError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        logger.info(
            "Kept the newest %d committed steps of job %s: %s",
            self.keep_latest_k,
            job,
            done.stdout.strip(),
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
