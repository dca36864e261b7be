"""The Hugging Face Trainer through ckptd: its whole checkpoint, saved asynchronously and
verified, with no pickle; resumed so that the run ends as if never interrupted.

    from ckpt.integrations.hf_trainer import CkptdTrainer   # instead of transformers.Trainer

    trainer = CkptdTrainer(model=model, args=args, train_dataset=ds, ckptd_path="/ckpts/run42")
    trainer.train(resume_from_checkpoint=True)   # the newest committed step, or a fresh start

Another Trainer class (SFTTrainer, a subclass of one's own) takes the mixin:
`class MyTrainer(CkptdTrainerMixin, SFTTrainer)`.

Every `save_steps` (the Trainer's own save schedule, strategy and save_total_limit, which
becomes keep_last) the Trainer's _save_checkpoint saves, as step `global_step` of the ckptd
job, what its own checkpoint-N holds: the model, the optimizer, the LR scheduler, the
gradient scaler (when there is one), the TrainerState (global step, epoch, log history,
best metric, the stateful callbacks' states) and each rank's RNG states (python, numpy,
torch, CUDA). The save is a Checkpointer's: training waits only for the copy to host
memory; hashing, writing, the cold re-read and the commit run in the background, the next
save (and the end of train()) waits for the previous one and raises its failure. DDP
replicas are written once. The Trainer's own checkpoint-N directory is not written
(`ckptd_keep_hf_checkpoint=True` writes it as well, e.g. for load_best_model_at_end).

Resume: `train(resume_from_checkpoint=True | <the ckptd path> | <step>)` loads through the
load policy (ckpt._load: the newest committed step in every rank's view, falling back to
older ones when a step is damaged, when no step is given), then hands the Trainer its state
at the points where its own resume restores it: the model before accelerator.prepare, the
optimizer, scheduler and scaler once created, the RNG states once the dataloader has skipped
the batches already trained. The Trainer reads a TrainerState only from a trainer_state.json
in the directory it resumes from: that one JSON file (the state as saved, not a pickle) is
written into a private temporary directory for the Trainer's own resume code to read, and
removed when train() returns. Any other string is a Trainer checkpoint directory, resumed
by the Trainer as always.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState

import ckpt
from ckptd.storage import JobLocation

__all__ = ["CkptdTrainer", "CkptdTrainerMixin"]

log = logging.getLogger("ckpt")

_MODEL, _OPTIM, _SCHED, _SCALER, _STATE, _RNG = (
    "model",
    "optimizer",
    "lr_scheduler",
    "scaler",
    "trainer_state",
    "rng",
)


class CkptdTrainerMixin:
    """The ckptd parts of CkptdTrainer, for any transformers.Trainer subclass (module doc).

    ckptd_path: the ckptd job (default `<output_dir>/ckptd`).
    ckptd_keep_hf_checkpoint: also write the Trainer's own checkpoint-N (default False: the
        state is saved once, through ckptd).
    ckptd_options: more Checkpointer arguments (verify, coordinator, token, mirror, ...).
    """

    # What the Trainer provides; declared for the type checker.
    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    callback_handler: Any
    control: Any
    hp_search_backend: Any

    def __init__(
        self,
        *args: Any,
        ckptd_path: str | os.PathLike[str] | None = None,
        ckptd_keep_hf_checkpoint: bool = False,
        ckptd_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.ckptd_path = str(
            ckptd_path if ckptd_path is not None else os.path.join(self.args.output_dir, "ckptd")
        )
        self.ckptd_keep_hf_checkpoint = ckptd_keep_hf_checkpoint
        self.ckptd_options = dict(ckptd_options or {})
        if self.args.load_best_model_at_end and not ckptd_keep_hf_checkpoint:
            raise ValueError(
                "load_best_model_at_end loads the best of the Trainer's own checkpoint-N "
                "directories, which CkptdTrainer does not write by default: pass "
                "ckptd_keep_hf_checkpoint=True, or load the best step from the ckptd job "
                f"{self.ckptd_path} yourself (its manifests hold each step's TrainerState)"
            )
        self._ckptd: ckpt.Checkpointer | None = None
        self._ckptd_resume: tuple[str, int] | None = None  # (temporary dir, step)

    # -- train: open the job, resume from it, wait for the last save -----------------------
    def train(  # resume_from_checkpoint also takes a step
        self,
        resume_from_checkpoint: str | bool | int | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        keep_last = self.args.save_total_limit
        self._ckptd = ckpt.Checkpointer(
            self.ckptd_path, **{"keep_last": keep_last, **self.ckptd_options}
        )
        try:
            resume = self._ckptd_resolve(resume_from_checkpoint)
            out = super().train(  # type: ignore[misc]
                resume_from_checkpoint=resume,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
            )
            self._ckptd.wait()  # the last save committed (or its failure raised) before return
            return out
        finally:
            cp, self._ckptd = self._ckptd, None
            if self._ckptd_resume is not None:
                shutil.rmtree(self._ckptd_resume[0], ignore_errors=True)
                self._ckptd_resume = None
            cp.close()

    def _ckptd_resolve(self, resume: str | bool | int | None) -> str | None:
        """What to hand the Trainer as resume_from_checkpoint (module docstring)."""
        if resume is None or resume is False:
            return None
        ours = resume is True or (isinstance(resume, int) and not isinstance(resume, bool))
        if isinstance(resume, str | os.PathLike) and not ours:
            ours = JobLocation.of(resume).path == JobLocation.of(self.ckptd_path).path
            if not ours:
                return str(resume)  # a Trainer checkpoint-N directory: the Trainer's own resume
        assert self._ckptd is not None
        step = resume if isinstance(resume, int) and not isinstance(resume, bool) else None
        if step is None and self._ckptd.latest_step() is None:
            log.info("ckptd job %s holds no committed step: a fresh start", self.ckptd_path)
            return None
        # The model now (the Trainer loads it before accelerator.prepare), with the
        # TrainerState: the load that chooses the step (and falls back) reads the most.
        got: dict[str, Any] = {_MODEL: self.model, _STATE: ""}
        res = self._ckptd.load(got, step, keys=[_MODEL, _STATE])
        tmp = tempfile.mkdtemp(prefix=f"ckptd-resume-step-{res.step}-")
        with open(os.path.join(tmp, TRAINER_STATE_NAME), "w") as f:
            f.write(got[_STATE])
        self._ckptd_resume = (tmp, res.step)
        log.info("resuming from step %d of ckptd job %s", res.step, self.ckptd_path)
        return tmp

    def _ckptd_step(self, checkpoint: str | None) -> int | None:
        """The ckptd step when `checkpoint` is this resume's directory, else None."""
        r = self._ckptd_resume
        return r[1] if r is not None and checkpoint == r[0] else None

    # -- the Trainer's resume hooks, fed from the ckptd step --------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._ckptd_step(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # else: loaded by _ckptd_resolve, before train() got this far

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        step = self._ckptd_step(checkpoint)
        if step is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        if self.args.save_only_model:
            return
        assert self._ckptd is not None
        got = {_OPTIM: self.optimizer, _SCHED: self.lr_scheduler}
        self._ckptd.load(got, step, keys=list(got))

    def _load_scaler(self, checkpoint: str | None) -> None:
        step = self._ckptd_step(checkpoint)
        if step is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or self.args.save_only_model:
            return
        assert self._ckptd is not None
        self._ckptd.load({_SCALER: scaler}, step, keys=[_SCALER])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        step = self._ckptd_step(checkpoint)
        if step is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        if self.args.save_only_model:
            return
        assert self._ckptd is not None
        self._ckptd.load({_RNG: ckpt.PerRank(ckpt.RNGState())}, step, keys=[_RNG])

    # -- the save ------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.ckptd_keep_hf_checkpoint:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        else:
            # What the Trainer's own _save_checkpoint does to its state before writing it.
            if self.hp_search_backend is None and trial is None:
                self.store_flos()  # type: ignore[attr-defined]
            self._ckptd_record_callbacks()
        self._ckptd_save()

    def _ckptd_record_callbacks(self) -> None:
        """The ExportableState callbacks' and TrainerControl's states into the TrainerState
        (as transformers' Trainer._save_checkpoint records them)."""
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, ExportableState):
                continue
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    def _ckptd_save(self) -> None:
        if self._ckptd is None:
            raise RuntimeError(
                "CkptdTrainer saves only inside train() (which opens the ckptd job "
                f"{self.ckptd_path}); call trainer.save_model(dir) for a model outside it"
            )
        # TrainerState.save_to_json's own encoding: a JSON document (not a pickle), as the
        # world's process zero writes it (the Trainer saves it from there): the two fields
        # that name the process are the only ones that differ between ranks, and a resume
        # sets them afresh (TrainerState.init_training_references).
        doc = dataclasses.asdict(self.state)
        doc.update(is_local_process_zero=True, is_world_process_zero=True)
        trainer_state = json.dumps(doc, indent=2, sort_keys=True)
        state: dict[str, Any] = {_MODEL: self.model, _STATE: trainer_state}
        if not self.args.save_only_model:
            state[_OPTIM] = self.optimizer
            state[_SCHED] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state[_SCALER] = scaler
            state[_RNG] = ckpt.PerRank(ckpt.RNGState())
        meta = {"transformers": {"global_step": self.state.global_step, "epoch": self.state.epoch}}
        # Returns once the state is in host memory; the rest runs in the background.
        self._ckptd.save(state, self.state.global_step, metadata=meta)


class CkptdTrainer(CkptdTrainerMixin, Trainer):
    """transformers.Trainer saving and resuming through ckptd (the module docstring)."""
