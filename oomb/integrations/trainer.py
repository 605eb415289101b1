"""transformers' Trainer with oomb's chunk-recurrent step: one import changes, the TrainingArguments stay.

    Trainer._inner_training_loop (unchanged): for each optimizer step
        get_batch_samples          -> the gradient_accumulation_steps batches and their target count T
        training_step x batches    -> oomb: chunked_backward(batch, loss_divisor=T); the loss it returns
        clip, optimizer, scheduler, log, evaluate, save          (unchanged)
    prediction_step                -> oomb's chunked_eval for the loss; the model's own forward for logits

transformers' own training step runs the model's forward and hands the loss to
``accelerator.backward``; oomb's step runs its own backward, chunk by chunk, newest first, so it
replaces ``training_step`` whole. Everything around it stays transformers': the optimizer and
schedule from the TrainingArguments, clipping, logging, evaluation, checkpoints, callbacks.

Gradient accumulation is exact: each batch's summed token loss is divided by the target count T
of all the step's batches (counted here from the labels, whatever the model's forward accepts),
so the step's gradient is that of the mean over every target token, the loss ``oomb train``
and transformers' own step (``num_items_in_batch``) compute.
"""

from __future__ import annotations

import math

import torch
from transformers import Trainer

from oomb.engine import StepOptions, chunked_backward, chunked_eval
from oomb.engine.evaluate import EvalResult
from oomb.engine.prepare import unwrap_peft
from oomb.engine.step import check_model_architecture
from oomb.engine.support import model_support
from oomb.integrations.batch import oomb_batch

# Optimizers that run the backward themselves (transformers' OptimizerNames values).
_BACKWARD_OPTIMIZERS = ("lomo", "adalomo")


class OombTrainerMixin:
    """The training and prediction steps of oomb for a ``transformers.Trainer`` subclass.

    Put it first: ``class MyTrainer(OombTrainerMixin, MyOtherTrainer)``. ``oomb_options`` (an
    ``oomb.engine.StepOptions``: chunk size, page size, page-sparse attention, offload) sets how the
    step runs; the default is StepOptions() (chunks of 4096 tokens, dense, exact).
    """

    def __init__(self, *args, oomb_options: StepOptions | None = None, **kwargs) -> None:
        if oomb_options is not None and not isinstance(oomb_options, StepOptions):
            raise TypeError(f"oomb_options must be an oomb.engine.StepOptions (e.g. StepOptions(chunk_size=8192)), "
                            f"got {type(oomb_options).__name__}")
        super().__init__(*args, **kwargs)
        self.oomb_options = oomb_options if oomb_options is not None else StepOptions()
        check_trainer_settings(self)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The step's batches and the number of tokens with a target in all of them (the loss divisor).

        transformers counts them only where the model's forward takes ``num_items_in_batch``; oomb's
        step always needs them, so they are counted here from the labels.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, sum(oomb_batch(b).target_count for b in batches)

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Gradients of one batch by ``chunked_backward``; returns its share of the step's mean loss."""
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimizers switch modes
            self.optimizer.train()
        batch = oomb_batch(self._prepare_inputs(inputs))
        count = batch.target_count
        if count == 0:  # a batch of prompts only: no loss, no gradient (transformers' own step would give 0 / 0)
            return torch.zeros((), device=self.args.device)
        if num_items_in_batch is None:  # not from the loop: one of the step's equal batches (as transformers)
            num_items_in_batch = count * getattr(self, "current_gradient_accumulation_steps", 1)
        loss = chunked_backward(self.accelerator.unwrap_model(model), batch.input_ids, batch.labels,
                                doc_ids=batch.doc_ids, attention_mask=batch.attention_mask,
                                loss_divisor=float(num_items_in_batch), options=self.oomb_options)
        return loss.to(self.args.device)

    def prediction_step(self, model: torch.nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The batch's mean loss by ``chunked_eval`` (one chunk of activations at a time).

        Where logits are wanted (a ``compute_metrics``), the model runs its own forward over the
        whole sequence with its own attention (memory grows with the length, as without oomb).
        """
        if not prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        result = self.oomb_eval(model, inputs)
        has_target = result.has_target
        # NaN for a batch without targets, as transformers' mean over no tokens.
        loss = result.nll[has_target].mean() if bool(has_target.any()) else torch.tensor(math.nan)
        return loss.to(self.args.device), None, None

    # Whether evaluation reports each position's entropy (OombSFTTrainer's metrics, as TRL's); the loss alone
    # does not need it.
    oomb_eval_entropy = False

    def oomb_eval(self, model: torch.nn.Module, inputs: dict) -> EvalResult:
        """The batch's per-token NLL, argmax correctness (and entropy: ``oomb_eval_entropy``) by ``chunked_eval``."""
        batch = oomb_batch(self._prepare_inputs(inputs))
        return chunked_eval(self.accelerator.unwrap_model(model), batch.input_ids, batch.labels,
                            doc_ids=batch.doc_ids, attention_mask=batch.attention_mask, options=self.oomb_options,
                            entropy=self.oomb_eval_entropy)


class OombTrainer(OombTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training step is oomb's ``chunked_backward``.

        from oomb.engine import StepOptions
        from oomb.integrations import OombTrainer

        trainer = OombTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                              data_collator=..., oomb_options=StepOptions(chunk_size=8192))
        trainer.train()
    """


def check_trainer_settings(trainer: Trainer) -> None:
    """Refuse, before any step, the Trainer settings oomb's step cannot honour; say what to change."""
    args = trainer.args
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError(
            f"{'DeepSpeed' if trainer.is_deepspeed_enabled else 'FSDP'} is not supported by oomb's step: it runs its "
            "own backward chunk by chunk, outside the engine that partitions the model. Remove deepspeed=/fsdp= "
            "from the TrainingArguments (for several GPUs, `oomb train` under torchrun shards with FSDP2 itself)")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError(
            f"oomb's Trainer step runs in one process on one device (this run has {args.world_size} processes, "
            f"{args.n_gpu} GPUs in the process): launch one process and make one GPU visible "
            "(CUDA_VISIBLE_DEVICES=0). For data or tensor parallel training use `oomb train` under torchrun")
    parallel = getattr(trainer.accelerator, "parallelism_config", None)
    if parallel is not None:
        raise ValueError("a parallelism_config (context, sequence or tensor parallelism) is not supported by oomb's "
                         "step: remove it from the TrainingArguments")
    if args.fp16:
        raise ValueError(
            "fp16=True scales the loss for accelerate's backward, which oomb's step does not call, so the gradients "
            "would be unscaled wrongly: load the model in bfloat16 (dtype=torch.bfloat16) and set bf16=True, or "
            "fp16=False")
    dtype = trainer.model.get_input_embeddings().weight.dtype
    if args.bf16 and dtype != torch.bfloat16:
        raise ValueError(
            f"bf16=True asks for autocast, but the model's weights are {dtype} and oomb's paged store holds K/V in "
            "the model's own dtype (it runs outside autocast): load the model in bfloat16 "
            "(from_pretrained(..., dtype=torch.bfloat16)), or set bf16=False to train in "
            f"{str(dtype).removeprefix('torch.')}")
    if args.label_smoothing_factor:
        raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor}: oomb's fused loss is the plain "
                         "cross-entropy; set label_smoothing_factor=0")
    if trainer.compute_loss_func is not None:
        raise ValueError("compute_loss_func is not supported: oomb computes the cross-entropy itself, chunk by chunk, "
                         "without the logits a custom loss would need; remove it")
    if args.neftune_noise_alpha is not None:
        raise ValueError("neftune_noise_alpha adds fresh noise to every forward, and oomb runs each chunk's forward "
                         "twice (fill, then recompute): the two would differ. Set neftune_noise_alpha=None")
    if args.torch_compile:
        raise ValueError("torch_compile=True compiles the model's forward, which oomb's step does not call (it runs "
                         "the decoder chunk by chunk): set torch_compile=False")
    if str(getattr(args.optim, "value", args.optim)) in _BACKWARD_OPTIMIZERS:
        raise ValueError(f"optim={args.optim!r} runs the backward inside the optimizer, and oomb runs its own: "
                         "choose another optimizer (e.g. adamw_torch)")
    check_model(trainer.model)


def check_model(model: torch.nn.Module) -> None:
    """Refuse a model oomb cannot train exactly (oomb.engine.support: UnsupportedModel, a ValueError naming the
    feature), checked in training mode as the steps will run it."""
    model = unwrap_peft(model)
    was_training = model.training
    model.train()
    try:
        check_model_architecture(model)
        model_support(model)
    finally:
        model.train(was_training)
