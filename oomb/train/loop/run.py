"""One run's objects and what it does when a step cannot go on: save, or stop saying what is on disk.

Every stop raises RunStopped (oomb.train.loop.faults) with the command that continues the run;
docs/failures.md shows each message.
"""

from __future__ import annotations

import errno
import gc
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from oomb.engine import release_memory
from oomb.engine.diagnose import locate_nonfinite
from oomb.train.config.settings import Config
from oomb.train.config.step import step_options
from oomb.train.data.corpus import DataError
from oomb.train.data.identity import DataChanged, changed_files
from oomb.train.loop import distributed
from oomb.train.loop.faults import (
    EXIT_DATA,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_WRITE,
    RunStopped,
    StepAbandoned,
    StopRequest,
    memory_report,
    nonfinite_after_update,
    nonfinite_grads,
    resume_command,
    zero_embedding_starts,
)
from oomb.train.loop.model import base_model_name
from oomb.train.loop.reporting import first_line
from oomb.train.runfolder.checkpoint import (
    CheckpointError,
    NonFiniteCheckpointError,
    export_model,
    find_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from oomb.train.runfolder.runfiles import RunPathError


def write_failure(error: BaseException, folder: Path) -> str:
    """The error of a failed write and what to do about it (a full disk, permissions, or the error itself).

    A full disk surfaces as OSError(ENOSPC) from Python, as SafetensorError from safetensors and
    as a RuntimeError without an errno from torch.save: the free space decides. A link or a special file
    in the run folder (RunPathError) is no write failure: its message says which and what to do.
    """
    if isinstance(error, RunPathError):
        return str(error).removesuffix(", then run the command again")
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or (free is not None and free < 64 * 2**20) or "No space left" in str(error):
        room = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        return f"{text}.\nThe file system holding {folder} is full{room}: free space on it"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "ermission denied" in str(error):
        return f"{text}.\nThe folder {folder} cannot be written: fix its permissions"
    return f"{text}.\nFix what the error names"


@dataclass
class Run:
    """What the failure paths of one run need: its objects, and the newest step on disk."""

    cfg: Config
    out: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    inputs: object
    device: torch.device
    saved_step: int | None  # step of the newest checkpoint this run wrote or resumed from
    ctx: distributed.DistributedContext  # this process's rank (a single process: one rank of one)
    start: int = 0  # steps done before this process (a resumed run's checkpoint)
    skipped: int = 0  # non-finite steps skipped by this process (train.on_nonfinite=skip)
    loss_value: float = float("nan")  # the last step's loss
    started: float = 0.0  # perf_counter when the loop began
    validation: object = None  # oomb.train.eval.validation.Validation: the held-out batches, when the run has them
    memory_record: object = None  # oomb.train.loop.memory_record.MemoryRecord: train.memory_snapshot

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def newest_checkpoint(self) -> str:
        try:
            ckpt = find_checkpoint(self.out)
        except CheckpointError:  # resume= then starts the run again from step 1 with its config.json
            return "the run has no checkpoint yet (resuming starts it again from step 1)"
        return f"the newest checkpoint, {ckpt}, is intact"

    def save(self, step: int, data_state: dict | None = None) -> Path:
        """Write checkpoint ``step`` and rotate; a failed write stops the run (nothing on disk damaged).

        ``data_state``: the data position after step ``step`` (default: where the inputs stand now).
        """
        if data_state is None:
            data_state = self.inputs.state_dict()
        try:
            if not self.ctx.torchrun:  # one process: a plain checkpoint
                ckpt = save_checkpoint(self.out, step, self.model, self.optimizer, self.scheduler,
                                       data_state=data_state)
            else:
                ckpt = distributed.save_checkpoint(self.ctx, self.out, step, self.model, self.optimizer,
                                                   self.scheduler, data_state=data_state)
        except NonFiniteCheckpointError as e:
            raise RunStopped(f"{e}.\n{self.newest_checkpoint().capitalize()}. {self._nonfinite_advice()}",
                             EXIT_NONFINITE) from None
        except Exception as e:  # noqa: BLE001 - OSError, SafetensorError, torch.save's RuntimeError: all a failed write
            raise RunStopped(
                f"could not write checkpoint step {step} in {self.out / 'checkpoints'}: "
                f"{write_failure(e, self.out)}.\nNothing was damaged: no partial checkpoint was left and "
                f"{self.newest_checkpoint()}. Then continue with:\n  {resume_command(self.out)}", EXIT_WRITE) from None
        self.saved_step = step
        try:
            if self.ctx.is_main:
                rotate_checkpoints(self.out, self.cfg.train.keep_last)
        except OSError as e:  # the new checkpoint is complete; an old one stays for now
            Console(stderr=True).print(f"warning: could not delete an old checkpoint: {e}", highlight=False)
        return ckpt

    def checkpoint(self, step: int) -> None:
        """Write checkpoint ``step`` once the run's data files are checked (oomb.train.data.identity): a file
        that changed during the run (on any rank) stops it, exit code 6, after this checkpoint is written."""
        changed = changed_files()
        if not distributed.any_rank(self.ctx, bool(changed)):
            self.save(step)
            return
        ckpt = self.save(step)
        files = "\n  ".join(changed or ["a data file of another rank (it names the file)"])
        raise RunStopped(f"a data file changed during the run (found when checkpoint {step} was due):\n  "
                         f"{files}\nThe model and optimizer after step {step} were saved to {ckpt}.\n"
                         f"{self._changed_data_advice()}", EXIT_DATA)

    def _changed_data_advice(self) -> str:
        return (f"Put the file back as it was (the run resumes at the same row), then continue with:\n  "
                f"{resume_command(self.out)}\nor go on with the data as it is now with:\n  "
                f"{resume_command(self.out, 'data.accept_changed=true')}")

    def write_failed(self, what: str, step: int, error: BaseException):
        """A run file other than a checkpoint (metrics, config) could not be written: stop, nothing lost on disk."""
        lost = (f"Step {step} was trained but is not saved; " if self.saved_step != step else "")
        raise RunStopped(f"could not write {what}: {write_failure(error, self.out)}.\n{lost}"
                         f"{self.newest_checkpoint()}. Then continue with:\n  {resume_command(self.out)}",
                         EXIT_WRITE) from None

    def export(self, tokenizer) -> Path:
        try:
            if self.ctx.torchrun:
                return distributed.export_model(self.ctx, self.model, self.out, tokenizer=tokenizer,
                                                merge_lora=self.cfg.lora.merge_on_export,
                                                base_model=base_model_name(self.cfg))
            return export_model(self.model, self.out, merge_lora=self.cfg.lora.merge_on_export, tokenizer=tokenizer,
                                base_model=base_model_name(self.cfg))
        except Exception as e:  # noqa: BLE001 - a failed write of any kind; export.tmp was removed
            raise RunStopped(
                f"could not write the export in {self.out / 'export'}: {write_failure(e, self.out)}.\nTraining is "
                f"complete and {self.newest_checkpoint()}; no partial export was left. Write the export with:\n"
                f"  {resume_command(self.out)}", EXIT_WRITE) from None

    def stop_on_signal(self, stop: StopRequest, done: int, dropped: int | None = None, data_state: dict | None = None):
        ckpt = find_checkpoint(self.out) if self.saved_step == done else self.save(done, data_state)
        what = f"step {dropped} was in progress and is dropped; " if dropped is not None else ""
        by = stop.name or "a signal to another rank"  # under torchrun, every rank stops when one is signalled
        raise RunStopped(
            f"interrupted by {by} after step {done} of {self.cfg.train.steps} ({what}checkpoint {ckpt}).\n"
            f"Continue with:\n  {resume_command(self.out)}", EXIT_INTERRUPTED)

    def read_batches(self, step: int, data_state: dict) -> list:
        """Step ``step + 1``'s batches; data that cannot be read any more (read as the run goes: a file
        removed, a streamed dataset unreachable) stops the run after saving step ``step``."""
        try:
            return self.inputs.batches(step)
        except DataError as e:
            self.stop_on_data_error(step, e, data_state)

    def stop_on_data_error(self, step: int, error: Exception, data_state: dict):
        """The data of step ``step + 1`` could not be read: keep step ``step`` (and the data position before)."""
        if self.saved_step == step:
            kept = f"The model and optimizer are as after step {step}; {self.newest_checkpoint()}."
        elif self.ctx.torchrun:  # a save needs every rank
            kept = f"Step {step} is not saved (under torchrun one rank cannot save alone); {self.newest_checkpoint()}."
        else:
            kept = f"The model and optimizer after step {step} were saved to {self.save(step, data_state)}."
        advice = (self._changed_data_advice() if isinstance(error, DataChanged) else
                  "Fix what the message names, keeping the data as it was (the run resumes at the same row), then "
                  f"continue with:\n  {resume_command(self.out)}")
        raise RunStopped(f"could not read the data of step {step + 1}: {error}\n{kept}\n{advice}", EXIT_DATA)

    def stop_out_of_memory(self, step: int, where: str, error: str, use, *, model_intact: bool = True,
                           data_state: dict | None = None):
        """Free what the step held, keep what is good, and say what used the memory."""
        recorded = None
        if self.memory_record is not None:  # train.memory_snapshot: the record up to the failure, before the frees
            try:
                recorded = self.memory_record.stop(f"at the out-of-memory error of step {step + 1}")
            except Exception as e:  # noqa: BLE001 - a full disk, or too little host memory to pickle it
                recorded = f"memory record not written: {first_line(e)}"
        self.optimizer.zero_grad(set_to_none=True)  # no optimizer step happened (or it failed)
        release_memory(self.model)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not model_intact:
            kept = ("The optimizer step itself ran out of memory, so the weights in memory may be partly updated: "
                    f"they are not saved; {self.newest_checkpoint()}.")
        elif self.saved_step == step:
            kept = f"The model and optimizer are as after step {step}; {self.newest_checkpoint()}."
        elif self.ctx.torchrun:  # a save needs every rank, and the others are inside the step's collectives
            kept = f"Step {step} is not saved (under torchrun one rank cannot save alone); {self.newest_checkpoint()}."
        else:
            try:
                kept = (f"The model and optimizer are as after step {step} and were saved to "
                        f"{self.save(step, data_state)}.")
            except (RunStopped, Exception) as e:  # noqa: BLE001 - still out of memory, a CUDA error, a full disk
                kept = f"Saving step {step} failed too ({str(e).splitlines()[0]}); {self.newest_checkpoint()}."
        t = self.cfg.train
        smaller = t.chunk_size // 2 // t.page_size * t.page_size
        change = f"train.chunk_size={smaller}" if smaller >= t.page_size else "train.layer_checkpointing=true"
        raise RunStopped(
            f"out of memory in {where} of step {step + 1}: {error}\n"
            f"Memory when it failed:\n{memory_report(use, self.cfg, model=self.model)}\n"
            + (f"{recorded}\n" if recorded else "") + f"{kept}\n"
            f"Change a setting above and continue, e.g.:\n  {resume_command(self.out, change)}",
            EXIT_OUT_OF_MEMORY)

    def nonfinite(self, step: int, loss, grad_norm, batches) -> dict:
        """Locate the first non-finite value; stop (train.on_nonfinite=stop) or return what to log (skip)."""
        t = self.cfg.train
        site = None
        if self.ctx.torchrun:  # every rank gets here (global loss and norm); locating would need them in step
            parameter = "not located under torchrun (run one process from the last checkpoint to locate it)"
            layers = None
            self.optimizer.zero_grad(set_to_none=True)
            site, batches = "not located under torchrun", []
        else:
            parameter, layers = nonfinite_grads(self.model)
            self.optimizer.zero_grad(set_to_none=True)
        try:
            for m, batch in enumerate(batches):  # the grad_accum batches in the order they ran
                doc_ids = batch.doc_ids.to(self.device) if batch.doc_ids is not None else None
                site = locate_nonfinite(self.model, batch.input_ids.to(self.device), batch.labels.to(self.device),
                                        options=step_options(self.cfg), doc_ids=doc_ids)  # the step's options
                if site is not None:
                    if len(batches) > 1:
                        site = f"{site}, in batch {m + 1} of {len(batches)} (train.grad_accum)"
                    break
        except StepAbandoned:  # a signal during the diagnosis: report without it, then stop as asked
            site = "not located (interrupted)"
        cause = zero_embedding_starts(self.model, batches) if site is None and batches else None
        where = (f"first non-finite value: {site}" if site is not None else
                 "the forward pass is finite in every chunk: the first non-finite value arose in the backward pass"
                 + (f"; {layers}" if layers else "") + (f"; likely cause: {cause}" if cause else ""))
        text = (f"non-finite {'loss' if not bool(torch.isfinite(loss)) else 'gradient'} in step {step + 1} "
                f"(loss {float(loss)}, gradient norm {float(grad_norm)}); {where}; first parameter with a non-finite "
                f"gradient: {parameter or 'none'}")
        if t.on_nonfinite == "skip":
            Console(stderr=True).print(f"warning: {text}; step skipped (no update)", highlight=False, soft_wrap=True)
            return {"nonfinite_at": str(site) if site is not None else "backward pass", "nonfinite_grad": parameter}
        advice = ("Begin the sequences with the tokenizer's BOS (not its padding token), or give that token an "
                  "embedding, then run again (docs/failures.md)" if cause else self._nonfinite_advice(skip=True))
        raise RunStopped(
            f"{text}.\nNo update was made and no checkpoint was written or changed; "
            f"{self.newest_checkpoint()}. {advice}", EXIT_NONFINITE)

    def _nonfinite_advice(self, skip: bool = False) -> str:
        """What to do after non-finite values: where a weight is non-finite before this run updated it (the
        loaded model's), a lower learning rate cannot help; else lower train.lr (or skip such steps)."""
        bad = next((n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None and self.saved_step is None and not any(self.optimizer.state.values()):  # no update yet
            return (f"The weight {bad} is non-finite and this run has not updated the model yet: the model it "
                    f"started from (model.path={self.cfg.model.path}) holds non-finite values; repair or replace it")
        lr = f"train.lr={self.cfg.train.lr / 2:g}"
        return (f"Lower train.lr{', or set train.on_nonfinite=skip,' if skip else ''} and continue, e.g.:\n"
                f"  {resume_command(self.out, lr)}")

    def check_update(self, step: int) -> None:
        """Stop if the optimizer step made a weight or its state non-finite (its gradients were finite).

        An update cannot be undone (no copy of the weights is kept), so train.on_nonfinite=skip
        does not apply: the run stops before anything is saved, whatever that setting says.
        """
        name = nonfinite_after_update(self.model, self.optimizer)
        bad = distributed.any_rank(self.ctx, name is not None)
        if not bad:
            return
        lr = self.scheduler.get_last_lr()[0]
        raise RunStopped(
            f"the update of step {step + 1} made {name or 'a weight on another rank'} non-finite (NaN or inf) from "
            f"finite gradients: the learning rate ({lr:g} at this step) is too large for these weights.\nThe updated "
            f"weights are not saved (an update cannot be undone, so train.on_nonfinite=skip does not apply); "
            f"{self.newest_checkpoint()}. Lower train.lr and continue, e.g.:\n"
            f"  {resume_command(self.out, f'train.lr={self.cfg.train.lr / 10:g}')}", EXIT_NONFINITE)
