"""TRL's SFTTrainer with oomb's chunk-recurrent step (needs ``pip install 'oomb[trl]'``).

SFTTrainer prepares the data as it always does (chat templates, ``assistant_only_loss``,
``completion_only_loss``, packing, ``padding_free``); its collator's labels (-100 where no loss)
and position_ids (restarting at 0 for each packed sample) are what oomb's step trains on.
"""

from __future__ import annotations

try:
    from trl import SFTTrainer
except ImportError as e:  # an optional extra
    raise ImportError("OombSFTTrainer needs TRL: pip install 'oomb[trl]' (or pip install trl)") from e

import torch

from oomb.engine.evaluate import EvalResult
from oomb.integrations.trainer import OombTrainerMixin


class OombSFTTrainer(OombTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose training step is oomb's ``chunked_backward``; takes ``oomb_options`` besides
    SFTTrainer's own arguments.

    SFTTrainer's ``compute_loss`` does not run here. Its metrics are kept as TRL computes them where oomb's step
    has what they need: ``num_tokens`` in training and evaluation, and in evaluation ``entropy`` and
    ``mean_token_accuracy`` over the tokens with a target (from ``chunked_eval``). Training logs no per-step
    entropy or token accuracy (oomb's fused loss never forms the logits' distribution).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sft = self.args
        if getattr(sft, "loss_type", "nll") != "nll":
            raise ValueError(f"loss_type={sft.loss_type!r}: oomb's step computes the plain negative log-likelihood; "
                             "set loss_type='nll' in the SFTConfig")
        if getattr(sft, "activation_offloading", False):
            raise ValueError("activation_offloading=True: oomb's step keeps one chunk's activations only, so there is "
                             "little to offload; set activation_offloading=False (or shrink oomb_options.chunk_size)")

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The tokens trained, counted as TRL's compute_loss counts them (padding-free rows have no attention mask).
        if "attention_mask" in inputs:
            count = int(inputs["attention_mask"].sum())
        elif "position_ids" in inputs:
            count = inputs["position_ids"].size(1)
        else:
            count = inputs["input_ids"].numel()
        self._total_train_tokens += count
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return loss

    oomb_eval_entropy = True  # eval_entropy, as TRL reports it

    def oomb_eval(self, model: torch.nn.Module, inputs: dict) -> EvalResult:
        result = super().oomb_eval(model, inputs)
        valid = result.has_target
        count = int(valid.sum())  # TRL's means over the tokens with a target, 0 for a batch without any
        metrics = self._metrics["eval"]
        metrics["entropy"].append(float(result.entropy[valid].double().sum() / count) if count else 0.0)
        metrics["mean_token_accuracy"].append(float(result.correct[valid].sum() / count) if count else 0.0)
        metrics["num_tokens"] = [self._total_train_tokens]
        return result
