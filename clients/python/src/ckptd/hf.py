"""Hugging Face transformers' Trainer checkpointing through ckptd: ``from ckptd.hf import Trainer``.

ckptd.hf.Trainer is transformers.Trainer with its checkpoint saves and
resumes going through a ckptd daemon. Each save (``save_strategy``,
``save_steps``) stages one ckptd step at ``state.global_step`` and returns
once the state is copied into the daemon's shared memory; no
``checkpoint-N`` folder is written. Rank 0's shard holds the model (and its
config.json, so ``ckptd export`` writes a folder ``from_pretrained``
loads), the optimizer, the scheduler, the scaler and the TrainerState;
every rank's holds its RNG states.

``train(resume_from_checkpoint=True)`` resumes from the newest committed
step of the job. See docs/frameworks.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from typing import Any

try:
    import transformers
    from transformers.trainer_callback import ExportableState
except ImportError as _err:  # pragma: no cover - depends on the environment
    from ._frameworks import missing

    raise missing("hf", "hf", _err) from None

import random

import numpy as np
import torch

from . import _frameworks as fw
from ._client import Client
from ._handle import SaveHandle

__all__ = ["Trainer"]

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(r"(?:^|/)checkpoint-(\d+)/?$")


class _Resume:
    """The step a train() resumes from, loaded, and the folder for transformers' small files."""

    def __init__(
        self, step: int, folder: str, model: dict[str, Any], optimizer: Any, extra: Any
    ) -> None:
        self.step, self.folder = step, folder
        self.model, self.optimizer, self.extra = model, optimizer, extra


class Trainer(transformers.Trainer):
    """transformers.Trainer whose checkpoints are ckptd steps.

    Takes transformers.Trainer's arguments, and these keywords:

    Args:
        ckptd_client: the ckptd.Client to use (default: one of its own on
            ckptd_socket, else $CKPTD_SOCKET or the daemon's default).
        ckptd_socket: the daemon's socket when no client is given.
        ckptd_job: the ckptd job (default: the daemon's).
        ckptd_wait_timeout: seconds train() waits, at its end, for this
            run's saves to commit (None: no limit).

    ``save_total_limit`` deletes nothing: the client cannot delete a stored
    step, so every step stays until ``ckptd prune --keep-last N`` (a
    warning says so once). FSDP and DeepSpeed are refused (they save
    sharded state their own way); ``load_best_model_at_end`` too (it reads
    ``checkpoint-N`` folders).
    """

    def __init__(
        self,
        *args: Any,
        ckptd_client: Client | None = None,
        ckptd_socket: str | None = None,
        ckptd_job: str | None = None,
        ckptd_wait_timeout: float | None = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise ValueError(
                "ckptd.hf.Trainer does not support load_best_model_at_end yet (it reloads a "
                "checkpoint-N folder, which ckptd does not write); load the best step with "
                "ckptd.torch.load_state_dict, or use transformers.Trainer"
            )
        self._ckptd_client = ckptd_client
        self._ckptd_socket = ckptd_socket
        self.ckptd_job = ckptd_job
        self.ckptd_wait_timeout = ckptd_wait_timeout
        self._ckptd_lock = threading.Lock()
        self._ckptd_pending: list[SaveHandle] = []
        self._ckptd_resume: _Resume | None = None
        self._ckptd_warned_limit = False
        self._ckptd_resumed = False

    @property
    def ckptd_client(self) -> Client:
        """The ckptd client (made on first use when none was given)."""
        with self._ckptd_lock:
            if self._ckptd_client is None:
                self._ckptd_client = Client(self._ckptd_socket)
            return self._ckptd_client

    # ---- saving --------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Stage this rank's shard of the step state.global_step (instead of a folder)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError(
                "ckptd.hf.Trainer does not save FSDP or DeepSpeed state yet; use "
                "transformers.Trainer for those (or ckptd.dcp with FSDP2)"
            )
        self._ckptd_raise_failed()
        self._ckptd_warn_limit()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = self.state.global_step
        rank, world = self.args.process_index, self.args.world_size
        extra: dict[str, Any] = {}
        if not self.args.save_only_model:
            extra["rng"] = _rng_states(self.args.parallel_mode)
        optimizer = None
        saved_model: Any = {}
        if rank == 0:
            kept: Any = self.state.stateful_callbacks  # as transformers.Trainer keeps them
            for cb in [*self.callback_handler.callbacks, self.control]:
                if not isinstance(cb, ExportableState):
                    continue
                name, state = cb.__class__.__name__, cb.state()
                if isinstance(kept[name], list):
                    kept[name].append(state)
                else:
                    kept[name] = state
            extra["trainer_state"] = json.dumps(
                dataclasses.asdict(self.state), indent=2, sort_keys=True
            )
            saved_model = self.accelerator.unwrap_model(self.model)
            if not self.args.save_only_model:
                opt: Any = self.optimizer
                sched: Any = self.lr_scheduler
                optimizer = opt.state_dict()
                extra["scheduler"] = sched.state_dict()
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    extra["scaler"] = scaler.state_dict()
        h = fw.stage(
            self.ckptd_client, step, saved_model, optimizer=optimizer, extra=fw.portable(extra),
            rank=rank, world_size=world, job=self.ckptd_job, timeout=self.ckptd_wait_timeout,
            resumed=self._ckptd_resumed,
        )  # fmt: skip
        if h is not None:
            with self._ckptd_lock:
                self._ckptd_pending.append(h)

    def _ckptd_warn_limit(self) -> None:
        if self.args.save_total_limit is None or self._ckptd_warned_limit:
            return
        self._ckptd_warned_limit = True
        warnings.warn(
            f"ckptd.hf.Trainer keeps every step: save_total_limit={self.args.save_total_limit} "
            "deletes nothing (the client cannot delete a stored step); run `ckptd prune "
            f"--keep-last {self.args.save_total_limit}` on the daemon's store",
            RuntimeWarning,
            stacklevel=3,
        )

    def _ckptd_raise_failed(self) -> None:
        with self._ckptd_lock:
            done = [h for h in self._ckptd_pending if h.done()]
            self._ckptd_pending = [h for h in self._ckptd_pending if not h.done()]
        for h in done:
            h.result()

    def ckptd_wait(self, timeout: float | None = None) -> None:
        """Wait for this run's saves to commit; raise the first that failed."""
        with self._ckptd_lock:
            pending, self._ckptd_pending = self._ckptd_pending, []
        for h in pending:
            h.wait(timeout)

    # ---- resuming ------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers.Trainer.train, resuming from a ckptd step.

        resume_from_checkpoint: True resumes from the newest committed step
        of the job (ValueError when there is none, as transformers says);
        an int, or a path whose last part is ``checkpoint-<step>`` that is
        no folder of transformers' own, names a step; an existing
        transformers checkpoint folder loads as transformers.Trainer loads
        it. At the end train() waits for this run's saves to commit.
        """
        step = self._ckptd_step(resume_from_checkpoint)
        if step is None:
            out = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        else:
            folder = self._ckptd_prepare(step)
            try:
                out = super().train(folder, trial, ignore_keys_for_eval, **kwargs)
            finally:
                self._ckptd_resume = None
                shutil.rmtree(folder, ignore_errors=True)
        self.ckptd_wait(self.ckptd_wait_timeout)
        return out

    def _ckptd_step(self, resume: Any) -> int | None:
        """The step resume names (agreed by every rank), or None for transformers' own."""
        if resume is None or resume is False:
            return None
        step: int | None
        if resume is True:
            step = self.ckptd_client.latest_step(self.ckptd_job)
            step = fw.agree(step)
            if step is None:
                job = self.ckptd_job or "the daemon's default job"
                raise ValueError(
                    f"No committed ckptd step of {job} to resume from (ckptd.hf.Trainer); "
                    "train without resume_from_checkpoint to start afresh"
                )
            return step
        if isinstance(resume, int):
            return resume
        path = os.fspath(resume)
        if os.path.isfile(os.path.join(path, TRAINER_STATE)):
            return None  # a folder transformers wrote
        m = _CHECKPOINT_DIR.search(path)
        if m is None:
            raise ValueError(
                f"resume_from_checkpoint={resume!r}: ckptd.hf.Trainer resumes from True (the "
                "newest committed step), a step number, or a path ending in checkpoint-<step>"
            )
        return int(m.group(1))

    def _ckptd_prepare(self, step: int) -> str:
        """Load step; write the small files transformers reads into a folder of their own."""
        client, job = self.ckptd_client, self.ckptd_job
        rank = self.args.process_index
        main = fw.load(client, step, job=job, rank=0)
        mine = main if rank == 0 else fw.load(client, step, job=job, rank=rank)
        extra = fw.unportable(main.extra, allow_pickle=False, where=f"step {step}")
        own = fw.unportable(mine.extra, allow_pickle=False, where=f"step {step} rank {rank}")
        folder = tempfile.mkdtemp(prefix=f"ckptd-hf-checkpoint-{step}-")
        with open(os.path.join(folder, TRAINER_STATE), "w") as f:
            f.write(extra["trainer_state"])
        if "rng" in own:
            name = f"rng_state_{rank}.pth" if self.args.world_size > 1 else "rng_state.pth"
            torch.save(own["rng"], os.path.join(folder, name))
        if "scaler" in extra:
            torch.save(extra["scaler"], os.path.join(folder, "scaler.pt"))
        self._ckptd_resume = _Resume(step, folder, main.model, main.optimizer, extra)
        self._ckptd_resumed = True
        return folder

    def _ours(self, checkpoint: Any) -> _Resume | None:
        r = self._ckptd_resume
        return r if r is not None and checkpoint == r.folder else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        r = self._ours(resume_from_checkpoint)
        if r is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(r.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        r = self._ours(checkpoint)
        if r is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if r.optimizer is None:  # saved with save_only_model
            return
        opt: Any = self.optimizer
        sched: Any = self.lr_scheduler
        opt.load_state_dict(r.optimizer)
        sched.load_state_dict(r.extra["scheduler"])


def _rng_states(parallel_mode: Any) -> dict[str, Any]:
    """The RNG states transformers.Trainer saves (rng_state.pth), for CPU and CUDA."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        distributed = parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
        states["cuda"] = (
            torch.cuda.random.get_rng_state_all()
            if distributed
            else torch.cuda.random.get_rng_state()
        )
    return states
