"""Checks of a run's configuration that need no model, data or process group.

Everything here runs before any heavy work (model build, data streaming, DeepSpeed), so a bad
value costs a second, names itself and says what would be valid.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from model import GPTConfig


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names it and the valid choices."""


def check(cfg) -> GPTConfig:
    """Validate the whole run config; returns the model config. Raises ConfigError."""
    try:
        model_cfg = GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    _check_batches(cfg)
    _check_parallel(cfg, model_cfg)
    _check_train(cfg)
    from train import data

    try:
        data.check_data_config(cfg.data)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return model_cfg


def world_size() -> int:
    """Processes in this run, as the launcher (torchrun, deepspeed, SLURM via torchrun) declares it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")
    return value


def _check_batches(cfg) -> None:
    global_batch = _positive_int("train.global_batch_size", cfg.train.global_batch_size)
    micro = _positive_int("train.micro_batch_size", cfg.train.micro_batch_size)
    dp = world_size() // (cfg.parallel.tp * cfg.parallel.pp) or 1
    if global_batch % (micro * dp):
        fits = [m for m in range(1, global_batch + 1) if global_batch % (m * dp) == 0]
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size={micro} × "
            f"data-parallel size {dp}; micro batch sizes that fit: {fits}"
        )


def _check_parallel(cfg, model_cfg: GPTConfig) -> None:
    tp = _positive_int("parallel.tp", cfg.parallel.tp)
    pp = _positive_int("parallel.pp", cfg.parallel.pp)
    zero = cfg.parallel.zero_stage
    if (tp, pp, zero) != (1, 1, 0):
        raise ConfigError(
            f"parallel.tp={tp}, parallel.pp={pp}, parallel.zero_stage={zero}: this build trains with "
            f"tp=1, pp=1, zero_stage=0 only (tensor, pipeline and ZeRO parallelism are not wired in yet)"
        )
    if world_size() % (tp * pp):
        raise ConfigError(f"world size {world_size()} is not a multiple of parallel.tp × parallel.pp = {tp * pp}")


def _check_train(cfg) -> None:
    _positive_int("train.max_steps", cfg.train.max_steps)
    _positive_int("logging.log_interval", cfg.logging.log_interval)
    for key in ("eval_interval", "eval_batches", "checkpoint_interval", "sample_tokens"):
        value = cfg.train[key]
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"train.{key}={value!r}: must be a non-negative integer")
    if cfg.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={cfg.train.device!r}: must be one of ['auto', 'cpu', 'cuda']")
    if cfg.logging.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(
            f"logging.wandb.mode={cfg.logging.wandb.mode!r}: must be one of ['offline', 'online', 'disabled']"
        )
