"""oomb's step inside other training loops: transformers' Trainer and TRL's SFTTrainer.

    from oomb.integrations import OombTrainer       # in place of transformers.Trainer
    from oomb.integrations import OombSFTTrainer    # in place of trl.SFTTrainer (imports trl)

User-facing like oomb.train; nothing in the package imports it. docs/trainer.md.
"""

from oomb.integrations.batch import OombBatch, oomb_batch
from oomb.integrations.trainer import OombTrainer, OombTrainerMixin, check_trainer_settings


def __getattr__(name: str):
    if name == "OombSFTTrainer":  # imported on first use: TRL is an optional extra
        from oomb.integrations.sft import OombSFTTrainer

        return OombSFTTrainer
    raise AttributeError(f"module 'oomb.integrations' has no attribute {name!r}")


__all__ = ["OombBatch", "OombSFTTrainer", "OombTrainer", "OombTrainerMixin", "check_trainer_settings", "oomb_batch"]
