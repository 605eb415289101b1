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

from oomb.integrations.trainer import OombTrainerMixin


class OombSFTTrainer(OombTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose training step is oomb's ``chunked_backward``; takes ``oomb_options`` besides
    SFTTrainer's own arguments.

    SFTTrainer's ``compute_loss`` does not run in training, so its per-step ``entropy``,
    ``mean_token_accuracy`` and ``num_tokens`` are not logged (``loss`` and ``grad_norm`` are).
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
