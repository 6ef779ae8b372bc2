"""`python -m train.plan <the same Hydra overrides as training>`: what a layout holds, sends and computes.

  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 \\
      train.global_batch_size=1536 parallel.zero_stage=1 parallel.activation_checkpointing=1
  python -m train.plan model=gpt3-175b plan.gpus=1024 train.global_batch_size=1536 plan.search=true
  python -m train.plan model=gpt3-13b plan.gpus=64 plan.hardware=a100-40g plan.format=json
  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 plan.dry_run=true

It composes the training config (configs/config.yaml) with the `plan` group (configs/plan/default.yaml)
and prints, per rank of the first, middle and last pipeline stage, what the layout holds, computes,
sends and how long a step takes (train/planner/estimate.py). Nothing is built. plan.dry_run=true instead
builds every distinct rank's shard of the model on the meta device and checks that together they
hold each parameter exactly once (train/planner/dry_run.py).
"""

from __future__ import annotations

import contextlib
import json
import sys

from omegaconf import OmegaConf

from model import GPTConfig
from train.config.command_line import explain
from train.config.entry import CONFIG_DIR, EXIT_BAD_INPUT, EXIT_FAILED, quiet_library_warnings, register_config
from train.config.sections import ParallelConfig, PlanConfig, Sections
from train.config.settings import ConfigError
from train.planner.from_config import gpus_of, plan_from_config
from train.planner.search import search
from train.planner.tables import format_plan, format_search
from train.run.checks import check_model


def compose(overrides: list[str]):
    """Training's config plus the plan group, with the command line's overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_config()
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="plan"):
        return hydra_compose("config", overrides=["+plan=default", *overrides])


def load(overrides: list[str]):
    """(the run config's sections, the plan section, the model config) of the composed config; ConfigError
    naming the first bad override or value."""
    try:
        cfg = compose(overrides)
    except Exception as error:  # Hydra refused an override: name it, in its field's words where it has one
        raise ConfigError(explain(["+plan=default", *overrides], "config", error)) from None
    model_cfg = check_model(OmegaConf.to_container(cfg.model, resolve=True))
    return Sections.of(cfg), OmegaConf.to_object(cfg.plan), model_cfg


def run(overrides: list[str], out=sys.stdout, err=sys.stderr) -> int:
    """The command; returns its exit status (2: a bad config, 1: a failed dry run)."""
    with contextlib.redirect_stdout(err):  # DeepSpeed announces its accelerator on import: keep stdout clean
        import deepspeed.runtime.utils  # noqa: F401
    try:
        sections, plan_cfg, model_cfg = load(overrides)
    except ConfigError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    if plan_cfg.dry_run:
        return _dry_run(model_cfg, sections.parallel, plan_cfg, out, err)
    try:
        plan = plan_from_config(sections, plan_cfg, model_cfg)
        if plan_cfg.search:
            plans = search(
                plan.model, plan.layout.gpus, plan.layout.global_batch, plan.hardware,
                gpus_per_node=plan_cfg.gpus_per_node, reserved_gib=plan.reserved_gib, tokens=plan.tokens,
                implementation=plan.implementation,
            )
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    if plan_cfg.format == "json":
        document = plan.to_json()
        if plan_cfg.search:
            document["search"] = [p.to_json() | {"ranks": None} for p in plans[: plan_cfg.top]]
        print(json.dumps(document, indent=2), file=out)
    else:
        print(format_plan(plan), file=out)
        if plan_cfg.search:
            print(f"\nlayouts on {plan.layout.gpus} GPUs that fit, fastest first:\n" + format_search(plans, plan_cfg.top), file=out)
    return 0


def _dry_run(model_cfg: GPTConfig, par: ParallelConfig, plan_cfg: PlanConfig, out, err) -> int:
    """plan.dry_run=true: build and check the layout's shards (the batch does not matter here)."""
    from parallel.topology import check_layout
    from train.planner.dry_run import dry_run
    from train.runtime.process_group import skip_shared_memory_op

    try:
        check_layout(model_cfg.n_head, model_cfg.d_ff, par.tp, par.pp, model_cfg.n_layer, gpus_of(plan_cfg, par))
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    skip_shared_memory_op()  # the fake process groups never communicate: no op to compile
    report = dry_run(model_cfg, par.tp, par.pp, log=lambda line: print(line, file=err, flush=True))
    if report.ok:
        print(f"dry run: built all {report.shards} distinct rank shards (tp × pp) on meta in {report.seconds:.1f} s; "
              f"together they hold each of the {report.full_parameters:,} parameters exactly once", file=out)
        return 0
    print(f"dry run FAILED: shards cover {report.covered_parameters:,} of {report.full_parameters:,} parameters", file=out)
    for problem in report.problems:
        print(f"  {problem}", file=out)
    return EXIT_FAILED


if __name__ == "__main__":
    quiet_library_warnings()
    sys.exit(run(sys.argv[1:]))
