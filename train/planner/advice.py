"""What fits instead, when a planned layout does not: the fastest layout of the same model and global batch
on the same GPUs (the search, train/planner/search.py, which also chooses the micro batch), or, when none
fits there, the model's tested recipes (configs/recipe/: each named <model>-<gpu>x<count>), or more GPUs."""

from __future__ import annotations

import re

from train.config.entry import CONFIG_DIR
from train.planner.estimate import Plan
from train.planner.from_config import layout_overrides
from train.planner.search import search

RECIPE_GPUS = re.compile(r"x(\d+)(?:-|$)")  # a recipe's name has its GPU count: gpt3-175b-h100x1024(-fp8)


def what_fits(plan: Plan, fitting: list[Plan] | None = None) -> str:
    """One line saying what would fit in place of `plan`'s layout (see the module docstring); `fitting`: the
    search's result for its GPUs, if it has run (None: it runs here)."""
    lay, model = plan.layout, plan.model
    where = f"{lay.gpus} GPU(s) of {plan.hardware.name}"
    if fitting is None:
        fitting = search(model, lay.gpus, lay.global_batch, plan.hardware, gpus_per_node=plan.gpus_per_node,
                         reserved_gib=plan.reserved_gib, tokens=plan.tokens, implementation=plan.implementation)
    if fitting:
        best = fitting[0]
        return (f"the fastest layout that fits on {where} (the search's best of {len(fitting)}): "
                f"{layout_overrides(best.layout)} ({best.peak_memory_gib:.1f} GiB, {best.tokens_per_s:,.0f} tokens/s, "
                f"MFU {100 * best.predicted_mfu:.1f}%); plan.search=true ranks them all")
    none = f"no layout of {model.name} fits on {where} with a global batch of {lay.global_batch}"
    recipes = recipes_for(model.name)
    if recipes:
        commands = " or ".join(f"python -m train.plan {recipe}" for recipe in recipes)
        return f"{none}; its recipe{' does' if len(recipes) == 1 else 's do'}: {commands}"
    return f"{none}; add GPUs (plan.gpus), with a global batch they can split (train.global_batch_size)"


def recipes_for(model_name: str) -> list[str]:
    """The overrides that plan each recipe of configs/recipe/ for this model: +recipe=NAME plan.gpus=N."""
    from omegaconf import OmegaConf

    found = []
    for path in sorted((CONFIG_DIR / "recipe").glob("*.yaml")):
        defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
        if any(isinstance(entry, dict) and entry.get("override /model") == model_name for entry in defaults):
            count = RECIPE_GPUS.search(path.stem)
            found.append(f"+recipe={path.stem}" + (f" plan.gpus={count.group(1)}" if count else ""))
    return found
