"""The checks that span sections: what no one section can decide about itself.

A section checks its own fields when it is built (train/config/sections/, train/config/settings.py).
What remains needs two sections, the launch, the disk or DeepSpeed: the layout against the model and
the world size, the batch against the layout, the data against the batch and the layout, the batch
ramp against the model, the resume point and a Hugging Face start against the model, DeepSpeed's
pass-through against what gpt3d writes itself. Each runs before any heavy work (model build, data
streaming, DeepSpeed) and is one ConfigError naming the value and what would be valid;
train/run/spec.py calls them in order.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import DictConfig

from model import GPTConfig
from train.config.sections import DataConfig, GenerateConfig, ParallelConfig, TrainConfig
from train.config.sections.parallel import AUTO, AUTO_KEYS
from train.config.sections.train import OVERWRITE
from train.config.settings import ConfigError
from train.runtime.resolve import Runtime, resolve_runtime

GPT2_VOCAB = 50257  # token ids reach 50256 (<|endoftext|>)


def check_keys(cfg: DictConfig, config_name: str, overrides: list[str]) -> None:
    """No key beyond those the config files define, in any group (train/config/keys.py). Raises ConfigError."""
    from train.config.keys import check_known_keys

    try:
        check_known_keys(cfg, config_name, overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_model(values: dict) -> GPTConfig:
    """model.* (the model group's mapping) as a GPTConfig, whose vocabulary holds the GPT-2 BPE's tokens."""
    try:
        model_cfg = GPTConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if model_cfg.vocab_size < GPT2_VOCAB:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the GPT-2 BPE's {GPT2_VOCAB} tokens; "
            f"use {GPT2_VOCAB} (or more)"
        )
    return model_cfg


def check_runtime(train: TrainConfig) -> Runtime:
    """train.device and train.precision resolved on this machine (train/runtime/resolve.py): the device must
    exist here and the precision run on it (fp8: a GPU with float8 tensor cores, or the CPU, and torchao
    installed)."""
    try:
        return resolve_runtime(train)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def world_size() -> int:
    """Processes in this run, as the launcher (torchrun, deepspeed, SLURM via torchrun) declares it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_parallel(parallel: ParallelConfig, model_cfg: GPTConfig, extras: dict) -> int:
    """The layout against the model and the world size, sequence parallelism against the sequence, and
    DeepSpeed's pass-through; returns the data-parallel size."""
    from parallel.topology import check_layout

    try:
        dp = check_layout(model_cfg.n_head, model_cfg.d_ff, parallel.tp, parallel.pp, model_cfg.n_layer, world_size())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if parallel.sequence_parallel and model_cfg.seq_len % parallel.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs model.seq_len={model_cfg.seq_len} divisible by parallel.tp={parallel.tp}"
        )
    if parallel.pp > 1:
        check_stages(parallel, model_cfg.n_layer)
    check_deepspeed_extras(extras)
    return dp


def check_stages(parallel: ParallelConfig, n_layer: int) -> None:
    """The virtual pipeline stages fit the model: each holds at least one block, and parallel.stage_layers, when
    given, counts model.n_layer blocks."""
    stages = parallel.virtual_stage_count
    if stages > n_layer:
        raise ConfigError(f"parallel.pipeline_schedule={parallel.pipeline_schedule} with pp={parallel.pp} runs {stages} "
                          f"virtual stages: model.n_layer={n_layer} gives fewer than one block each")
    if parallel.stage_layers is not None and sum(parallel.stage_layers) != n_layer:
        raise ConfigError(f"parallel.stage_layers={list(parallel.stage_layers)} holds {sum(parallel.stage_layers)} blocks: "
                          f"model.n_layer={n_layer}")


def check_layout_mode(parallel: ParallelConfig, set_keys: list[str]) -> str:
    """parallel.layout=auto chooses the AUTO_KEYS itself (train/planner/elastic.py): none of them may be set
    on the command line (`set_keys`). Returns the mode."""
    if parallel.layout == AUTO:
        fixed = [key for key in AUTO_KEYS if key in set_keys]
        if fixed:
            raise ConfigError(f"parallel.layout=auto chooses {', '.join(AUTO_KEYS)}; drop {', '.join(fixed)} from the "
                              "command line, or set parallel.layout=manual")
    return parallel.layout


def check_batches(train: TrainConfig, dp: int, parallel: ParallelConfig | None = None) -> None:
    """The global batch splits into whole micro batches on every data-parallel rank, and under the interleaved
    schedule with several chunks a rank into groups of pp micro batches (Megatron's order)."""
    global_batch, micro = train.global_batch_size, train.micro_batch_size
    if global_batch % (micro * dp):
        fits = [m for m in range(1, global_batch + 1) if global_batch % (m * dp) == 0]
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size={micro} × "
            f"data-parallel size {dp}; micro batch sizes that fit: {fits}"
        )
    groups = micro_batch_groups(parallel) if parallel is not None else 1
    if (global_batch // (micro * dp)) % groups:
        raise ConfigError(
            f"parallel.pipeline_schedule=interleaved runs micro batches in groups of pp={groups}: "
            f"train.global_batch_size={global_batch} makes {global_batch // (micro * dp)} micro batches of "
            f"{micro} a step on each of {dp} data-parallel ranks; make them a multiple of {groups} (global batch a "
            f"multiple of {micro * dp * groups})")


def micro_batch_groups(parallel: ParallelConfig) -> int:
    """The number the micro batches of every step must be a multiple of: pp under the interleaved schedule with
    several chunks a rank, else 1."""
    from parallel.schedules.orders import INTERLEAVED

    interleaving = parallel.pp > 1 and parallel.pipeline_schedule == INTERLEAVED and parallel.virtual_stages > 1
    return parallel.pp if interleaving else 1


def check_data(data_cfg: DataConfig, train: TrainConfig, seq_len: int, dp: int, streams_set: bool = True):
    """The data config, the batch geometry over streams and ranks, and a cheap probe of the corpus (it must
    hold training documents for every stream and, when validation is on, a validation split that holds
    train.eval_batches global batches of seq_len + 1 tokens, or at least one where at most 10% of a small
    corpus cannot hold them all); returns the probe's DataSpec (train/data/probe.py: check_data), whose
    data.streams is the configured one or, when the user did not set it (`streams_set` False) and the
    corpus has too few documents for it, a smaller one, and whose `val_batches` the splits hold."""
    from train import data
    from train.data.probe import Evaluation

    validation = train.eval_interval > 0 and train.eval_batches > 0
    evaluation = Evaluation(seq_len + 1, train.global_batch_size, train.eval_batches) if validation else None
    try:
        return data.check_data(data_cfg, dp_size=dp, global_batch=train.global_batch_size, evaluation=evaluation,
                               streams_set=streams_set)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_batch_ramp(train: TrainConfig, model_cfg: GPTConfig, dp: int, streams: int, groups: int = 1):
    """train.batch_ramp: valid on its own (train/run/batch_ramp.py), and every batch it takes splits into
    whole micro batches on every data-parallel rank (in `groups` of them: micro_batch_groups) and takes the
    same number of windows from every stream, i.e. start and increment are multiples of lcm(data.streams,
    micro batch × dp × groups). Returns the BatchRamp."""
    from train.run.batch_ramp import from_config

    try:
        ramp = from_config(train, model_cfg.seq_len)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    micro = train.micro_batch_size
    unit = math.lcm(streams, micro * dp * groups)
    for key, n in (("start", ramp.start), ("increment", ramp.increment)):
        if not ramp.enabled or n % unit == 0:
            continue
        per, name = (model_cfg.seq_len, "tokens") if train.batch_ramp.unit == "tokens" else (1, "sequences")
        if key == "start":  # a start from which the increment (the start itself, if null) reaches the full batch
            step = train.batch_ramp.increment is not None and ramp.increment
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


def check_resume(train: TrainConfig, run_dir: Path, model_cfg: GPTConfig):
    """The checkpoint train.resume names for a run in `run_dir`: None (a fresh start) or its ResumePoint
    (train/run/schedule.py), whose state.json holds this model (ConfigError otherwise)."""
    from train.checkpoint.resume_point import resume_point

    resume = "none" if train.resume == OVERWRITE else train.resume  # a fresh start in a cleared folder
    try:
        return resume_point(resume, run_dir, model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


class RunFinished(Exception):
    """The checkpoint a run resumes already reached train.max_steps: nothing is left to train (exit 0)."""


def check_unfinished(train: TrainConfig, resume) -> None:
    """Raise RunFinished, worded for the user, when the resume point is at or past train.max_steps."""
    if resume is not None and resume.state["step"] >= train.max_steps:
        raise RunFinished(f"already finished at step {resume.state['step']}; raise train.max_steps to go on, or choose "
                          "a new run folder (hydra.run.dir=PATH)")


def check_resume_data(resume, data_spec, seq_len: int, seed: int) -> None:
    """A resume continues its checkpoint's data position only on the same data in the same order
    (train/data/order.py): one line naming what changed, then → now, and the ways out."""
    if resume is None or "data" not in resume.state:
        return
    from train.data.order import changes, stream_id

    changed = changes(resume.state["data"]["stream"], stream_id(data_spec, seq_len, seed))
    if changed:
        raise ConfigError(
            f"the checkpoint {resume.folder} (step {resume.state['step']}) was trained on other data: "
            f"{'; '.join(changed)}. To resume it, set these back; to train on this data instead, start a new run: "
            f"another run folder (hydra.run.dir=PATH), or train.resume=overwrite (moves the old run aside)"
        )


def check_init_from(train: TrainConfig, model_cfg: GPTConfig) -> None:
    """train.init_from is a Hugging Face GPT-2 folder of this model's shape."""
    if train.init_from is None:
        return
    from train.checkpoint.hugging_face import check_init_from as check_folder

    try:
        check_folder(Path(str(train.init_from)), model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_deepspeed_extras(extras: dict) -> None:
    """The `deepspeed` group: known top-level DeepSpeed keys only, none that gpt3d writes itself
    (train/run/engine.py: owned_deepspeed_keys, derived from the code that writes them)."""
    if not extras:
        return
    import difflib

    from deepspeed.runtime import constants

    from train.run.engine import owned_deepspeed_keys

    owned_keys = owned_deepspeed_keys()
    known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    known |= {"zero_optimization", "comms_logger", "flops_profiler", "activation_checkpointing", "tensorboard",
              "wandb", "csv_monitor", "aio", "compile", "torch_autocast", "data_types", "timers"}
    for key, value in extras.items():
        paths = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) else []
        for owned in [key, *paths]:
            if owned in owned_keys:
                raise ConfigError(f"deepspeed.{owned} is set by gpt3d from {owned_keys[owned]}; set that instead")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            raise ConfigError(f"deepspeed.{key} is not a DeepSpeed setting" + (f"; did you mean {near}?" if near else ""))


def check_generation(generate: GenerateConfig, parallel: ParallelConfig, model_values: dict,
                     model_given: list[str]) -> tuple[GPTConfig, Path]:
    """A `python -m train.generate` config beyond its sections' own checks; returns the model config and
    the checkpoint folder to read. The model is the checkpoint's: `model_given`, the model keys set on the
    command line (`model.KEY`, or `model` for a size), replace its values where they may differ (how it
    computes), and a shape other than the checkpoint's is refused in generation's words. Raises ConfigError."""
    from train.checkpoint import model_differences, saved_model_config, tag_folder

    try:
        folder = tag_folder(Path(generate.checkpoint))
        saved = saved_model_config(folder)
    except ValueError as err:
        raise ConfigError(f"generate.checkpoint: {err}") from None
    given = {key.removeprefix("model.") for key in model_given if key.startswith("model.")}
    values = dict(model_values) if "model" in model_given else {**saved, **{k: model_values.get(k) for k in given}}
    model_cfg = check_model(values)
    differing = model_differences(saved, model_cfg)
    if differing:
        raise ConfigError(
            f"generate.checkpoint={generate.checkpoint} holds a model with "
            + ", ".join(f"model.{k}={saved.get(k)!r}" for k in differing)
            + f", not {', '.join(repr(getattr(model_cfg, k, None)) for k in differing)}; generation reads the model from "
            "its checkpoint, so model.* need not be given: drop "
            + ("model=..." if "model" in model_given else ", ".join(f"model.{k}" for k in differing))
            + " from the command line"
        )
    check_parallel(parallel, model_cfg, {})
    return model_cfg, folder
