"""`python -m train.plan <the same Hydra overrides as training>`: what a layout holds, sends and computes.

  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 \\
      train.global_batch_size=1536 parallel.zero_stage=1 parallel.activation_checkpointing=1
  python -m train.plan model=gpt3-175b plan.gpus=1024 train.global_batch_size=1536 plan.search=true
  python -m train.plan model=gpt3-13b plan.gpus=64 plan.hardware=a100-40g plan.format=json
  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 plan.dry_run=true

It composes the training config (configs/config.yaml) with the `plan` group (configs/plan/default.yaml)
and prints, per rank of the first, middle and last pipeline stage, what the layout holds, computes,
sends and how long a step takes (train/planner/estimate.py). Nothing is built. A layout that does not fit
ends with one line saying what would (train/planner/advice.py) and exit status 1. plan.search=true ranks
every valid layout on the GPUs, choosing the micro batch too; the configured layout is shown in full when
the trainer would take it, else the search's fastest. plan.dry_run=true instead builds every distinct
rank's shard of the model on the meta device and checks that together they hold each parameter exactly
once (train/planner/dry_run.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import TYPE_CHECKING

from train.config.entry import CONFIG_DIR, EXIT_BAD_INPUT, EXIT_FAILED, quiet_library_warnings, register_config
from train.config.sections import ParallelConfig, PlanConfig, Sections
from train.config.settings import ConfigError
from train.config.usage import Help, answer_help, section_settings

if TYPE_CHECKING:  # (model imports torch: --help answers before the heavy imports)
    from model import GPTConfig


def command_help() -> Help:
    """What `python -m train.plan --help` says."""
    return Help(
        usage=("python -m train.plan [GROUP=CHOICE ...] [KEY=VALUE ...]   (training's overrides, plus plan.*)",),
        purpose="Predicts, from the config alone and for GPUs you may not have, what a training layout needs: each "
                "rank's memory at its peak, the FLOPs and bytes of a step, the step time by part, tokens/s, MFU and "
                "the days for plan.tokens. A layout that does not fit says what would (exit 1); plan.search=true "
                "ranks every layout that fits, micro batch included. Nothing is built.",
        settings_title="settings (KEY=VALUE; and training's model.*, parallel.*, train.*)",
        settings=section_settings(PlanConfig),
        examples=("python -m train.plan model=gpt3-175b plan.gpus=1024 train.global_batch_size=1536 plan.search=true",
                  "python -m train.plan +recipe=gpt3-175b-h100x1024 plan.gpus=1024     # GPT-3 175B on 1,024 H100s"),
        more="what the planner counts and models, and how it was checked: docs/planner.md",
    )


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
    from omegaconf import OmegaConf

    from train.config.command_line import check_given, explain
    from train.run.checks import check_model

    try:
        cfg = compose(overrides)
    except Exception as error:  # Hydra refused an override: name it, in its field's words where it has one
        raise ConfigError(explain(["+plan=default", *overrides], "config", error)) from None
    check_given(cfg, "python -m train.plan")
    model_cfg = check_model(OmegaConf.to_container(cfg.model, resolve=True))
    sections = Sections.of(cfg)
    return sections, OmegaConf.to_object(cfg.plan), _compiled_as_run(model_cfg, sections, overrides)


def _compiled_as_run(model_cfg: GPTConfig, sections: Sections, overrides: list[str]) -> GPTConfig:
    """model.compile as a run on a GPU takes it: under fp8 the blocks compile unless model.compile=false is given
    (train.runtime.precision.fp8_compile)."""
    import dataclasses

    from train.runtime.precision import fp8_compile

    given = any(o.lstrip("+").split("=", 1)[0] == "model.compile" for o in overrides)
    compiled, _ = fp8_compile(sections.train.precision, model_cfg.compile, given)
    return dataclasses.replace(model_cfg, compile=compiled)


def run(overrides: list[str], out=sys.stdout, err=sys.stderr) -> int:
    """The command; returns its exit status (2: a bad config, 1: a layout that does not fit, or a failed dry
    run)."""
    with contextlib.redirect_stdout(err):  # DeepSpeed announces its accelerator on import: keep stdout clean
        import deepspeed.runtime.utils  # noqa: F401
    from train.planner.advice import what_fits
    from train.planner.from_config import gpus_of, plan_from_config
    from train.planner.tables import format_plan, format_search, fp8_summary

    try:
        sections, plan_cfg, model_cfg = load(overrides)
    except ConfigError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    if plan_cfg.dry_run:
        return _dry_run(model_cfg, sections.parallel, plan_cfg, out, err)
    try:
        if plan_cfg.search:
            plan, plans, note = _searched(sections, plan_cfg, model_cfg)
        else:
            plan, plans, note = plan_from_config(sections, plan_cfg, model_cfg), None, None
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    advice = None if plan is None or plan.fits or plans else what_fits(plan, plans)
    if plan_cfg.format == "json":
        document = plan.to_json() if plan is not None else {}
        fp8 = fp8_summary(plan) if plan is not None else None
        if fp8 is not None:
            document["fp8"] = {**fp8["choice"].to_json(), "bf16_step_s": fp8["bf16_step_s"], "gain": fp8["gain"]}
        if plans is not None:
            document["search"] = [p.to_json() | {"ranks": None} for p in plans[: plan_cfg.top]]
        if advice is not None:
            document["instead"] = advice
        print(json.dumps(document, indent=2), file=out)
    else:
        shown = [format_plan(plan)] if plan is not None else []
        if note is not None:
            shown.append(note)
        if plans is not None:
            shown.append(f"layouts on {gpus_of(plan_cfg, sections.parallel)} GPUs that fit, fastest first:\n"
                         + format_search(plans, plan_cfg.top))
        if advice is not None:
            shown.append(f"DOES NOT FIT; instead: {advice}")
        print("\n\n".join(shown), file=out)
    return 0 if (plan is not None and plan.fits) or plans else EXIT_FAILED


def _searched(sections: Sections, plan_cfg: PlanConfig, model_cfg: GPTConfig):
    """plan.search=true: (the plan to show in full, the layouts that fit fastest first, a note or None). The plan
    shown is the configured layout's when the trainer would take it, else the search's fastest (None if none
    fits), with a note saying why."""
    from train.planner.from_config import gpus_of, hardware_from_config, implementation_from_config, plan_from_config
    from train.planner.search import search

    train, parallel = sections.train, sections.parallel
    plans = search(model_cfg, gpus_of(plan_cfg, parallel), train.global_batch_size, hardware_from_config(plan_cfg),
                   gpus_per_node=plan_cfg.gpus_per_node, reserved_gib=float(plan_cfg.reserved_gib),
                   tokens=float(plan_cfg.tokens),
                   implementation=implementation_from_config(train, parallel, model_cfg.compile,
                                                             deepspeed=sections.deepspeed))
    try:
        return plan_from_config(sections, plan_cfg, model_cfg), plans, None
    except ValueError as problem:
        best = plans[0] if plans else None
        shown = "the search's fastest layout is shown" if best else "no layout fits"
        return best, plans, f"the configured layout is not one the trainer takes ({problem}); {shown}"


def _dry_run(model_cfg: GPTConfig, par: ParallelConfig, plan_cfg: PlanConfig, out, err) -> int:
    """plan.dry_run=true: build and check the layout's shards (the batch does not matter here)."""
    from parallel.topology import check_layout
    from train.planner.dry_run import dry_run
    from train.planner.from_config import gpus_of, stage_split
    from parallel.topology import skip_shared_memory_op

    try:
        check_layout(model_cfg.n_head, model_cfg.d_ff, par.tp, par.pp, model_cfg.n_layer, gpus_of(plan_cfg, par))
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    skip_shared_memory_op()  # the fake process groups never communicate: no op to compile
    report = dry_run(model_cfg, par.tp, par.pp, log=lambda line: print(line, file=err, flush=True),
                     split=stage_split(par))
    if report.ok:
        print(f"dry run: built all {report.shards} distinct rank shards (tp × pp) on meta in {report.seconds:.1f} s; "
              f"together they hold each of the {report.full_parameters:,} parameters exactly once", file=out)
        return 0
    print(f"dry run FAILED: shards cover {report.covered_parameters:,} of {report.full_parameters:,} parameters", file=out)
    for problem in report.problems:
        print(f"  {problem}", file=out)
    return EXIT_FAILED


if __name__ == "__main__":
    answer_help(sys.argv[1:], command_help)
    quiet_library_warnings()
    sys.exit(run(sys.argv[1:]))
