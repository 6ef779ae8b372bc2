"""k-shot prompts: k solved examples from the task's own train or dev split before each item.

As the paper built them (Brown et al. 2020, section 2.4): for item i, k examples drawn at random
from the task's few-shot split, without replacement, each written as its gold context followed by
its gold continuation, joined and followed by the item with FEWSHOT_DELIMITER ("\\n\\n"). The draw
for item i is random.Random(seed · 1000003 + i).sample(...), so it depends on the seed and the item
alone: the same prompts in every run, at every layout, whatever `limit` cuts. When the examples
come from the scored split itself (tasks without a training split, e.g. LAMBADA), item i is left
out of its own draw.
"""

from __future__ import annotations

import random

from train.evaluation.items import FEWSHOT_DELIMITER, Item


def with_examples(items: tuple[Item, ...], pool: tuple[Item, ...], k: int, seed: int, same_split: bool) -> tuple[Item, ...]:
    """`items` with k solved examples of `pool` before each (k = 0: unchanged)."""
    if k == 0:
        return items
    available = len(pool) - (1 if same_split else 0)
    if available < k:
        raise ValueError(f"{k}-shot prompts need {k} examples, but the few-shot split has only {available}")
    out = []
    for i, item in enumerate(items):
        candidates = [j for j in range(len(pool)) if not (same_split and j == i)]
        chosen = random.Random(seed * 1000003 + i).sample(candidates, k)
        prefix = "".join(pool[j].solved + FEWSHOT_DELIMITER for j in chosen)
        out.append(item.after(prefix))
    return tuple(out)
