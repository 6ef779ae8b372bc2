"""The whole model's weights from a checkpoint, for the commands that run a trained model (generate, evaluate)."""

from __future__ import annotations

from pathlib import Path

import torch

from model import GPTConfig


def checkpoint_weights(folder: Path, model_cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The whole model's weights from a checkpoint folder, refused (ConfigError) when the checkpoint
    is of another model than model.* describes."""
    from train import checkpoint
    from train.config.settings import ConfigError

    try:
        checkpoint.check_model(checkpoint.saved_model_config(folder) or {}, model_cfg, folder)
        return checkpoint.read_model_weights(folder, model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
