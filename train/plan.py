"""The planner: `python -m train.plan <the same Hydra overrides as training>`.

  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 \\
      train.global_batch_size=1536 parallel.zero_stage=1 parallel.activation_checkpointing=1
  python -m train.plan model=gpt3-175b plan.gpus=1024 train.global_batch_size=1536 plan.search=true
  python -m train.plan model=gpt3-13b plan.gpus=64 plan.hardware=a100-40g plan.format=json
  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 plan.dry_run=true

It composes the training config (configs/config.yaml) with the `plan` group (configs/plan/default.yaml)
and prints, per rank of the first, middle and last pipeline stage, what the layout holds, computes,
sends and how long a step takes (train/plan_model.py). Nothing is built. plan.dry_run=true instead
builds every distinct rank's shard of the model on the meta device and checks that together they
hold each parameter exactly once (parallel/plan_dry_run.py).

For a training run: `plan_for_run(cfg)` predicts the run's own layout on the visible GPU, and
`preflight(cfg)` (which `python -m train` calls after the config check when the device is CUDA)
stops a run whose predicted peak memory exceeds the device's before anything is built, with one
message giving that peak and the three fastest layouts on the same GPUs, global batch and model
that fit (leaving the default headroom for the CUDA context), as overrides to paste.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from omegaconf import OmegaConf

from model import GPTConfig
from train.plan_hardware import Hardware, for_cuda_device, preset
from train.plan_model import Layout, Plan, build_plan
from train.plan_report import format_plan, format_search
from train.plan_search import layout_problem, search
from train.validate import ConfigError

FORMATS = ("table", "json")
HEADROOM_GIB = 2.0  # what pre-flight's alternatives leave free (configs/plan/default.yaml: reserved_gib)


def model_config(cfg) -> GPTConfig:
    return GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))


def layout_from_config(cfg, gpus: int) -> Layout:
    """The run's layout on `gpus` GPUs; ValueError naming the problem when the trainer would refuse it."""
    par, tr = cfg.parallel, cfg.train
    model_cfg = model_config(cfg)
    tp, pp = par.tp, par.pp
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("plan.gpus", gpus),
                       ("train.global_batch_size", tr.global_batch_size), ("train.micro_batch_size", tr.micro_batch_size)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer")
    if gpus % (tp * pp):
        raise ValueError(f"plan.gpus={gpus} is not a multiple of tp·pp = {tp * pp} (parallel.tp={tp}, parallel.pp={pp})")
    layout = Layout(
        tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=tr.global_batch_size, micro_batch=tr.micro_batch_size,
        zero_stage=par.zero_stage, offload_optimizer=bool(par.offload_optimizer),
        sequence_parallel=bool(par.sequence_parallel), checkpoint_every=par.activation_checkpointing,
    )  # fmt: skip
    problem = layout_problem(model_cfg, layout)
    if problem:
        raise ValueError(problem)
    return layout


def hardware_from_config(plan_cfg) -> Hardware:
    overrides = OmegaConf.to_container(plan_cfg.device, resolve=True) if plan_cfg.get("device") else {}
    return preset(plan_cfg.hardware, overrides)


def _gpus(plan_cfg, cfg) -> int:
    if plan_cfg.gpus is not None:
        return plan_cfg.gpus
    return int(os.environ.get("WORLD_SIZE", cfg.parallel.tp * cfg.parallel.pp))


def plan_from_config(cfg) -> Plan:
    """The prediction `python -m train.plan` prints for a composed config (training's plus `plan`)."""
    plan_cfg = cfg.plan
    layout = layout_from_config(cfg, _gpus(plan_cfg, cfg))
    _check_plan_options(plan_cfg)
    return build_plan(
        model_config(cfg), layout, hardware_from_config(plan_cfg), gpus_per_node=plan_cfg.gpus_per_node,
        reserved_gib=float(plan_cfg.reserved_gib), tokens=float(plan_cfg.tokens),
    )  # fmt: skip


def plan_for_run(cfg, hardware: Hardware | None = None) -> Plan:
    """The prediction for a training run's own config: its layout on WORLD_SIZE GPUs of
    LOCAL_WORLD_SIZE per node, on the visible GPU (or `hardware`; without CUDA the h100-80g preset).
    Plan.to_json() is what to log with the run; Plan.predicted_mfu is the step log's comparison."""
    if hardware is None:
        import torch

        local = int(os.environ.get("LOCAL_RANK", 0))
        hardware = for_cuda_device(local) if torch.cuda.is_available() else preset("h100-80g")
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
    return build_plan(model_config(cfg), layout_from_config(cfg, world), hardware, gpus_per_node=per_node)


def _check_plan_options(plan_cfg) -> None:
    if plan_cfg.format not in FORMATS:
        raise ValueError(f"plan.format={plan_cfg.format!r}: must be one of {list(FORMATS)}")
    for key in ("gpus_per_node", "top"):
        value = plan_cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan.{key}={value!r}: must be a positive integer")
    for key in ("tokens", "reserved_gib"):
        value = plan_cfg[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"plan.{key}={value!r}: must be a non-negative number")


def compose(overrides: list[str]):
    """Training's config plus the plan group, with the command line's overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.__main__ import CONFIG_DIR  # also registers the config's resolvers

    with initialize_config_dir(version_base=None, config_dir=CONFIG_DIR, job_name="plan"):
        return hydra_compose("config", overrides=["+plan=default", *overrides])


def run(overrides: list[str], out=sys.stdout, err=sys.stderr) -> int:
    """The command; returns its exit status (2: a bad config, 1: a failed dry run)."""
    with contextlib.redirect_stdout(err):  # DeepSpeed announces its accelerator on import: keep stdout clean
        import deepspeed.runtime.utils  # noqa: F401
    try:
        cfg = compose(overrides)
    except Exception as error:  # Hydra's own message names the bad override
        print(f"gpt3d plan: error: {'; '.join(str(error).splitlines()[:2])}", file=err)
        return 2
    if cfg.plan.dry_run:
        return _dry_run(cfg, out, err)
    try:
        plan = plan_from_config(cfg)
        if cfg.plan.search:
            plans = search(
                plan.model, plan.layout.gpus, plan.layout.global_batch, plan.hardware,
                gpus_per_node=cfg.plan.gpus_per_node, reserved_gib=plan.reserved_gib, tokens=plan.tokens,
            )  # fmt: skip
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return 2
    if cfg.plan.format == "json":
        document = plan.to_json()
        if cfg.plan.search:
            document["search"] = [p.to_json() | {"ranks": None} for p in plans[: cfg.plan.top]]
        print(json.dumps(document, indent=2), file=out)
    else:
        print(format_plan(plan), file=out)
        if cfg.plan.search:
            print(f"\nlayouts on {plan.layout.gpus} GPUs that fit, fastest first:\n" + format_search(plans, cfg.plan.top), file=out)
    return 0


def _dry_run(cfg, out, err) -> int:
    """plan.dry_run=true: build and check the layout's shards (the batch does not matter here)."""
    from parallel.plan_dry_run import dry_run
    from parallel.topology import check_layout
    from train.engine import skip_shared_memory_op

    try:
        model_cfg, par = model_config(cfg), cfg.parallel
        check_layout(model_cfg.n_head, model_cfg.d_ff, par.tp, par.pp, model_cfg.n_layer, _gpus(cfg.plan, cfg))
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return 2
    skip_shared_memory_op()  # the fake process groups never communicate: no op to compile
    report = dry_run(model_cfg, par.tp, par.pp, log=lambda line: print(line, file=err, flush=True))
    if report.ok:
        print(f"dry run: built all {report.shards} distinct rank shards (tp × pp) on meta in {report.seconds:.1f} s; "
              f"together they hold each of the {report.full_parameters:,} parameters exactly once", file=out)  # fmt: skip
        return 0
    print(f"dry run FAILED: shards cover {report.covered_parameters:,} of {report.full_parameters:,} parameters", file=out)
    for problem in report.problems:
        print(f"  {problem}", file=out)
    return 1


def layout_overrides(layout: Layout) -> str:
    """The command-line overrides that select `layout` (its dp follows from the world size)."""
    return " ".join([
        f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.zero_stage={layout.zero_stage}",
        f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
        f"parallel.activation_checkpointing={layout.checkpoint_every}", f"train.micro_batch_size={layout.micro_batch}",
    ])  # fmt: skip


def failure_message(plan: Plan, alternatives: list[Plan]) -> str:
    worst = max(plan.ranks, key=lambda r: r.peak_bytes)
    hw, lay = plan.hardware, plan.layout
    text = (
        f"predicted peak memory {plan.peak_memory_gib:.1f} GiB per GPU (pipeline stage {worst.stage}) exceeds the "
        f"{hw.memory_gib:.1f} GiB of {hw.name} for {plan.model.name} with {lay.describe()} "
        f"({lay.global_batch} sequences per step on {lay.gpus} GPU(s)); "
    )
    if not alternatives:
        return text + "no layout of these GPUs fits this model and global batch: add GPUs or lower train.global_batch_size"
    choices = [
        f"({i}) {layout_overrides(p.layout)}: {p.peak_memory_gib:.1f} GiB, {p.tokens_per_s:,.0f} tokens/s"
        for i, p in enumerate(alternatives, 1)
    ]
    return text + "layouts that fit, fastest first: " + "; ".join(choices)


def preflight(cfg, hardware: Hardware | None = None) -> None:
    """Raise ConfigError (see module docstring) when the run's predicted peak exceeds the device's memory."""
    try:
        plan = plan_for_run(cfg, hardware)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if plan.peak_memory_gib <= plan.hardware.memory_gib:
        return
    alternatives = search(
        model_config(cfg), plan.layout.gpus, plan.layout.global_batch, plan.hardware,
        gpus_per_node=plan.gpus_per_node, reserved_gib=HEADROOM_GIB,
    )[:3]  # fmt: skip
    raise ConfigError(failure_message(plan, alternatives))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
