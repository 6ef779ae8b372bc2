"""Checks of a run's configuration that need no model, data or process group.

Everything here runs before any heavy work (model build, data streaming, DeepSpeed), so a bad
value costs a second, names itself and says what would be valid. No check changes the config:
train/config/spec.py calls them in order and keeps what they return.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from model import GPTConfig


GPT2_VOCAB = 50257  # token ids reach 50256 (<|endoftext|>)
OVERWRITE = "overwrite"  # train.resume: move an earlier run in the run folder aside (train/config/run_folder.py)


# parallel.layout: manual, the layout keys as given; auto, train/plan/elastic.py chooses these keys at each start.
MANUAL, AUTO = "manual", "auto"
LAYOUT_MODES = (MANUAL, AUTO)
AUTO_KEYS = (
    "parallel.tp", "parallel.pp", "parallel.zero_stage", "parallel.sequence_parallel",
    "parallel.activation_checkpointing", "parallel.offload_optimizer", "train.micro_batch_size",
)  # fmt: skip


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names it and the valid choices."""


def check_keys(cfg, config_name: str, overrides: list[str]) -> None:
    """No key beyond those the config files define, in any group (train/config/keys.py). Raises ConfigError."""
    from train.config.keys import check_known_keys

    try:
        check_known_keys(cfg, config_name, overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_data(cfg, dp: int, streams_set: bool = True) -> int:
    """The data config, the batch geometry over streams and ranks, and a cheap probe of the corpus (it must
    hold training documents for every stream, and validation ones when validation is on); returns the
    data.streams the run uses: the configured one, or, when the user did not set it (`streams_set` False)
    and the corpus has too few documents for it, a smaller one (train/data/probe.py: check_data)."""
    from train import data

    validation = cfg.train.eval_interval > 0 and cfg.train.eval_batches > 0
    try:
        spec = data.check_data(cfg.data, dp_size=dp, global_batch=cfg.train.global_batch_size, validation=validation,
                               streams_set=streams_set)
        return spec.streams
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_batch_ramp(cfg, model_cfg: GPTConfig, dp: int, streams: int):
    """train.batch_ramp: valid on its own (train/batch_ramp.py), and every batch it takes splits into
    whole micro batches on every data-parallel rank and takes the same number of windows from every
    stream, i.e. start and increment are multiples of lcm(data.streams, micro batch × dp). Returns the
    BatchRamp."""
    from train.batch_ramp import from_config

    try:
        ramp = from_config(cfg.train, model_cfg.seq_len)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    micro = cfg.train.micro_batch_size
    unit = math.lcm(streams, micro * dp)
    for key, n in (("start", ramp.start), ("increment", ramp.increment)):
        if not ramp.enabled or n % unit == 0:
            continue
        per, name = (model_cfg.seq_len, "tokens") if cfg.train.batch_ramp.unit == "tokens" else (1, "sequences")
        if key == "start":  # a start from which the increment (the start itself, if null) reaches the full batch
            step = cfg.train.batch_ramp.increment is not None and ramp.increment
            fits = [k for k in range(unit, ramp.full, unit) if (ramp.full - k) % (step or k) == 0]
        else:
            fits = [k for k in range(unit, ramp.full - ramp.start + 1, unit) if (ramp.full - ramp.start) % k == 0]
        raise ConfigError(
            f"train.batch_ramp.{key}={n * per} {name} ({n} sequences) is not a multiple of {unit} sequences, the least "
            f"common multiple of data.streams={streams} and train.micro_batch_size={micro} × data-parallel size {dp}: "
            f"each batch of the ramp takes the same number of windows from every stream and splits into whole micro "
            f"batches on every rank; {key} values that fit: {[k * per for k in fits[:6]] or 'none'} {name}"
        )
    return ramp


def check_generation(cfg) -> tuple[GPTConfig, Path]:
    """Validate a `python -m train.generate` config; returns the model config and the checkpoint
    folder to read. Raises ConfigError."""
    model_cfg = check_model(cfg)
    check_parallel(cfg, model_cfg)
    _check_seed_and_device(cfg)
    gen = cfg.generate
    if not isinstance(gen.prompt, str):
        raise ConfigError(f"generate.prompt={gen.prompt!r}: must be a string (quote it on the command line)")
    _positive_int("generate.max_new_tokens", gen.max_new_tokens)
    if not _is_number(gen.temperature) or gen.temperature < 0:
        raise ConfigError(f"generate.temperature={gen.temperature!r}: must be ≥ 0 (0: greedy)")
    if gen.top_k is not None:
        _positive_int("generate.top_k", gen.top_k)
    if gen.checkpoint is None:
        raise ConfigError("generate.checkpoint is not set: give a run directory, its checkpoints/ folder or one step folder")
    from train.checkpoint import tag_folder

    try:
        return model_cfg, tag_folder(Path(gen.checkpoint))
    except ValueError as err:
        raise ConfigError(f"generate.checkpoint: {err}") from None


def check_model(cfg) -> GPTConfig:
    try:
        model_cfg = GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if model_cfg.vocab_size < GPT2_VOCAB:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the GPT-2 BPE's {GPT2_VOCAB} tokens; "
            f"use {GPT2_VOCAB} (or more)"
        )
    return model_cfg


def world_size() -> int:
    """Processes in this run, as the launcher (torchrun, deepspeed, SLURM via torchrun) declares it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")
    return value


def check_batches(cfg, dp: int) -> None:
    global_batch = _positive_int("train.global_batch_size", cfg.train.global_batch_size)
    micro = _positive_int("train.micro_batch_size", cfg.train.micro_batch_size)
    if global_batch % (micro * dp):
        fits = [m for m in range(1, global_batch + 1) if global_batch % (m * dp) == 0]
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size={micro} × "
            f"data-parallel size {dp}; micro batch sizes that fit: {fits}"
        )


def check_parallel(cfg, model_cfg: GPTConfig) -> int:
    """The layout and its options; returns the data-parallel size."""
    from parallel.topology import check_layout

    par = cfg.parallel
    tp, pp = par.tp, par.pp
    try:
        dp = check_layout(model_cfg.n_head, model_cfg.d_ff, tp, pp, model_cfg.n_layer, world_size())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    zero = par.zero_stage
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={zero!r}: must be one of [0, 1, 2, 3]")
    if pp > 1 and zero > 1:
        raise ConfigError(
            f"parallel.zero_stage={zero} with parallel.pp={pp}: DeepSpeed's pipeline engine shards at most the "
            f"optimizer state; use zero_stage 0 or 1 with pp > 1, or pp=1 for ZeRO-{zero}"
        )
    if par.offload_optimizer and zero == 0:
        raise ConfigError("parallel.offload_optimizer=true needs parallel.zero_stage ≥ 1 (ZeRO-Offload moves ZeRO's optimizer shards)")
    if par.sequence_parallel and model_cfg.seq_len % tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs model.seq_len={model_cfg.seq_len} divisible by parallel.tp={tp}"
        )
    ckpt = par.activation_checkpointing
    if ckpt != "selective" and (not isinstance(ckpt, int) or isinstance(ckpt, bool) or ckpt < 0):
        raise ConfigError(
            f"parallel.activation_checkpointing={ckpt!r}: must be 0 (off), a positive block count or 'selective'"
        )
    if not isinstance(par.overlap_communication, bool):
        raise ConfigError(f"parallel.overlap_communication={par.overlap_communication!r}: must be true or false")
    _check_deepspeed_extras(cfg)
    return dp


def check_layout_mode(cfg, set_keys: list[str]) -> str:
    """parallel.layout: manual (the parallel.* and train.micro_batch_size values as given) or auto (chosen for
    the world size and device by train/plan/elastic.py, which then sets them: none of them may be set on the
    command line, `set_keys`). Returns the mode."""
    mode = cfg.parallel.layout
    if mode not in LAYOUT_MODES:
        raise ConfigError(f"parallel.layout={mode!r}: must be one of {list(LAYOUT_MODES)} (manual: the parallel.* "
                          "settings as given; auto: chosen for the world size and device)")
    if mode == AUTO:
        fixed = [key for key in AUTO_KEYS if key in set_keys]
        if fixed:
            raise ConfigError(f"parallel.layout=auto chooses {', '.join(AUTO_KEYS)}; drop {', '.join(fixed)} from the "
                              "command line, or set parallel.layout=manual")
        _positive_int("train.global_batch_size", cfg.train.global_batch_size)
    return mode


# Settings gpt3d derives from train.* / parallel.* / optim.*; the deepspeed group may not set them.
OWNED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size · dp)",
    "gradient_clipping": "optim.grad_clip",
    "optimizer": "optim.*",
    "scheduler": "optim.*",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer": "parallel.offload_optimizer",
    "pipeline.pipe_partitioned": "parallel.sequence_parallel",
    "pipeline.grad_partitioned": "parallel.sequence_parallel",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "torch_autocast": "train.precision",
    "data_types.grad_accum_dtype": "train.precision",
}


def _check_deepspeed_extras(cfg) -> None:
    """The `deepspeed` group: known top-level DeepSpeed keys only, none that gpt3d derives itself."""
    if "deepspeed" not in cfg or not cfg.deepspeed:
        return
    import difflib

    from deepspeed.runtime import constants

    extras = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    known |= {"zero_optimization", "comms_logger", "flops_profiler", "activation_checkpointing", "tensorboard",
              "wandb", "csv_monitor", "aio", "compile", "torch_autocast", "data_types", "timers"}
    for key, value in extras.items():
        paths = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) else []
        for owned in [key, *paths]:
            if owned in OWNED_DEEPSPEED_KEYS:
                raise ConfigError(f"deepspeed.{owned} is set by gpt3d from {OWNED_DEEPSPEED_KEYS[owned]}; set that instead")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            raise ConfigError(f"deepspeed.{key} is not a DeepSpeed setting" + (f"; did you mean {near}?" if near else ""))


def check_train(cfg) -> None:
    _positive_int("train.max_steps", cfg.train.max_steps)
    _check_seed_and_device(cfg)
    _check_precision(cfg)
    _positive_int("logging.log_interval", cfg.logging.log_interval)
    for key in ("eval_interval", "eval_batches", "checkpoint_interval", "sample_tokens"):
        value = cfg.train[key]
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"train.{key}={value!r}: must be a non-negative integer")
    _positive_int("train.max_consecutive_skips", cfg.train.max_consecutive_skips)
    for key in ("step_timeout_s", "collective_timeout_s"):
        value = cfg.train[key]
        if not _is_number(value) or value <= 0:
            raise ConfigError(f"train.{key}={value!r}: must be a positive number of seconds")
    if not isinstance(cfg.train.reset_schedule, bool):
        raise ConfigError(f"train.reset_schedule={cfg.train.reset_schedule!r}: must be true or false")
    if not isinstance(cfg.train.fused_loss, bool):
        raise ConfigError(f"train.fused_loss={cfg.train.fused_loss!r}: must be true or false")
    from train.metrics import WANDB_MODES

    wandb = cfg.logging.wandb
    if wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logging.wandb.mode={wandb.mode!r}: must be one of {list(WANDB_MODES)}")
    for key in ("project", "entity", "group", "notes", "job_type", "name"):
        if wandb[key] is not None and not isinstance(wandb[key], str):
            raise ConfigError(f"logging.wandb.{key}={wandb[key]!r}: must be text (or null)")
    tags = wandb.tags
    if tags is not None and (not isinstance(tags, (list, ListConfig)) or not all(isinstance(t, str) and t for t in tags)):
        raise ConfigError(f"logging.wandb.tags={tags!r}: must be a list of words, e.g. 'logging.wandb.tags=[baseline,125m]'")
    if not isinstance(wandb.log_checkpoints, bool):
        raise ConfigError(f"logging.wandb.log_checkpoints={wandb.log_checkpoints!r}: must be true or false")
    resume = cfg.train.resume
    if not isinstance(resume, str) and resume is not None:
        raise ConfigError(f"train.resume={resume!r}: must be auto, none, {OVERWRITE}, or a checkpoint path")


def check_resume(cfg, run_dir: Path, model_cfg: GPTConfig):
    """The checkpoint train.resume names for a run in `run_dir`: None (a fresh start) or its ResumePoint
    (train/checkpoint/resume_checks.py), whose state.json holds this model (ConfigError otherwise)."""
    from train.checkpoint.resume_checks import resume_point

    resume = "none" if cfg.train.resume == OVERWRITE else cfg.train.resume  # a fresh start in a cleared folder
    try:
        return resume_point(resume, run_dir, model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_checkpoint_settings(cfg, model_cfg: GPTConfig) -> None:
    """Retention (train.keep_checkpoints, train.keep_every), train.async_checkpoint (auto, true or false);
    train.init_from is a Hugging Face GPT-2 folder of this model's shape."""
    train = cfg.train
    _positive_int("train.keep_checkpoints", train.keep_checkpoints)
    if not isinstance(train.keep_every, int) or isinstance(train.keep_every, bool) or train.keep_every < 0:
        raise ConfigError(f"train.keep_every={train.keep_every!r}: must be a non-negative integer (0: keep none extra)")
    if not (train.async_checkpoint == "auto" or isinstance(train.async_checkpoint, bool)):
        raise ConfigError(f"train.async_checkpoint={train.async_checkpoint!r}: must be auto, true or false")
    if train.init_from is not None:
        from train.checkpoint.hugging_face import check_init_from

        try:
            check_init_from(Path(str(train.init_from)), model_cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_seed_and_device(cfg) -> None:
    seed = cfg.train.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise ConfigError(f"train.seed={seed!r}: must be an integer in [0, 2^31)")
    from train.engine import resolve_device

    try:
        resolve_device(cfg.train.device)  # also: cuda asked for where none is visible
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_precision(cfg) -> None:
    """train.precision (train/precision.py): a known value; the float8 settings, and under fp8 a device
    that runs it (train/precision.py: check_fp8), before anything is built."""
    from train.engine import resolve_device
    from train.precision import check_fp8, resolve_precision

    device = resolve_device(cfg.train.device)
    try:
        resolve_precision(cfg.train.precision, device)
        check_fp8(cfg.train, device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_optim(cfg) -> None:
    """AdamW's values in range (whether they make a schedule for this run: train/config/spec.py)."""
    optim = cfg.optim
    checks = [
        (optim.lr is None or (_is_number(optim.lr) and optim.lr > 0), "optim.lr", optim.lr, "null or > 0"),
        (_is_number(optim.eps) and optim.eps > 0, "optim.eps", optim.eps, "> 0"),
        (_is_number(optim.weight_decay) and optim.weight_decay >= 0, "optim.weight_decay", optim.weight_decay, "≥ 0"),
        (_is_number(optim.grad_clip) and optim.grad_clip >= 0, "optim.grad_clip", optim.grad_clip, "≥ 0 (0: no clipping)"),
        (_is_number(optim.min_lr_ratio) and 0 <= optim.min_lr_ratio <= 1, "optim.min_lr_ratio", optim.min_lr_ratio, "in [0, 1]"),
        (_is_number(optim.warmup_tokens) and optim.warmup_tokens >= 0, "optim.warmup_tokens", optim.warmup_tokens, "≥ 0"),
        (len(optim.betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in optim.betas), "optim.betas",
         list(optim.betas), "two numbers in [0, 1)"),
    ]
    for ok, key, value, valid in checks:
        if not ok:
            raise ConfigError(f"{key}={value!r}: must be {valid}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
