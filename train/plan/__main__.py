"""`python -m train.plan <the same Hydra overrides as training>`: what a layout holds, sends and computes.

  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 \\
      train.global_batch_size=1536 parallel.zero_stage=1 parallel.activation_checkpointing=1
  python -m train.plan model=gpt3-175b plan.gpus=1024 train.global_batch_size=1536 plan.search=true
  python -m train.plan model=gpt3-13b plan.gpus=64 plan.hardware=a100-40g plan.format=json
  python -m train.plan model=gpt3-175b parallel.tp=8 parallel.pp=16 plan.gpus=1024 plan.dry_run=true

It composes the training config (configs/config.yaml) with the `plan` group (configs/plan/default.yaml)
and prints, per rank of the first, middle and last pipeline stage, what the layout holds, computes,
sends and how long a step takes (train/plan/estimate.py). Nothing is built. plan.dry_run=true instead
builds every distinct rank's shard of the model on the meta device and checks that together they
hold each parameter exactly once (train/plan/dry_run.py).
"""

from __future__ import annotations

import contextlib
import json
import sys

from train.config.entry import CONFIG_DIR, EXIT_BAD_INPUT, EXIT_FAILED, register_resolvers
from train.plan.config import gpus_of, model_config, plan_from_config
from train.plan.report import format_plan, format_search
from train.plan.search import search


def compose(overrides: list[str]):
    """Training's config plus the plan group, with the command line's overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_resolvers()
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="plan"):
        return hydra_compose("config", overrides=["+plan=default", *overrides])


def run(overrides: list[str], out=sys.stdout, err=sys.stderr) -> int:
    """The command; returns its exit status (2: a bad config, 1: a failed dry run)."""
    with contextlib.redirect_stdout(err):  # DeepSpeed announces its accelerator on import: keep stdout clean
        import deepspeed.runtime.utils  # noqa: F401
    try:
        cfg = compose(overrides)
    except Exception as error:  # Hydra's own message names the bad override
        print(f"gpt3d plan: error: {'; '.join(str(error).splitlines()[:2])}", file=err)
        return EXIT_BAD_INPUT
    if cfg.plan.dry_run:
        return _dry_run(cfg, out, err)
    try:
        plan = plan_from_config(cfg)
        if cfg.plan.search:
            plans = search(
                plan.model, plan.layout.gpus, plan.layout.global_batch, plan.hardware,
                gpus_per_node=cfg.plan.gpus_per_node, reserved_gib=plan.reserved_gib, tokens=plan.tokens,
                implementation=plan.implementation,
            )  # fmt: skip
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
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
    from train.plan.dry_run import dry_run
    from parallel.topology import check_layout
    from train.engine import skip_shared_memory_op

    try:
        model_cfg, par = model_config(cfg), cfg.parallel
        check_layout(model_cfg.n_head, model_cfg.d_ff, par.tp, par.pp, model_cfg.n_layer, gpus_of(cfg.plan, cfg))
    except ValueError as error:
        print(f"gpt3d plan: error: {error}", file=err)
        return EXIT_BAD_INPUT
    skip_shared_memory_op()  # the fake process groups never communicate: no op to compile
    report = dry_run(model_cfg, par.tp, par.pp, log=lambda line: print(line, file=err, flush=True))
    if report.ok:
        print(f"dry run: built all {report.shards} distinct rank shards (tp × pp) on meta in {report.seconds:.1f} s; "
              f"together they hold each of the {report.full_parameters:,} parameters exactly once", file=out)  # fmt: skip
        return 0
    print(f"dry run FAILED: shards cover {report.covered_parameters:,} of {report.full_parameters:,} parameters", file=out)
    for problem in report.problems:
        print(f"  {problem}", file=out)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
