"""Each task family's metrics from its items' scores (one Score per request, train/evaluation/scorer.py).

For item j with choices i, log-likelihoods ℓ_ji = log p(continuation_i | context_i) and gold g_j:

  acc        mean_j [argmax_i ℓ_ji = g_j]                         multiple choice, Winograd
  acc_norm   mean_j [argmax_i ℓ_ji / chars_ji = g_j]              multiple choice; chars_ji the length
             of ending i in characters (lm-eval's normalisation; the paper divides by tokens)
  acc        mean_j [every token of the last word is the greedy one]   last word
  ppl        exp(−mean_j ℓ_j)                                    last word: the perplexity of the
             final word per word, as LAMBADA's papers and lm-eval report it

argmax takes the first of equal values, as numpy's does in lm-eval.
"""

from __future__ import annotations

import math

from train.evaluation.items import LAST_WORD, PARTIAL, Item, ending_length
from train.evaluation.scorer import Score


def _first_max(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def task_metrics(kind: str, items: tuple[Item, ...], scores: list[list[Score]]) -> dict[str, float]:
    """The metrics of one task: `scores[j]` are item j's scores, one per request."""
    if kind == LAST_WORD:
        return {"acc": sum(s[0].greedy for s in scores) / len(items),
                "ppl": math.exp(-sum(s[0].logprob for s in scores) / len(items))}
    acc = acc_norm = 0
    for item, item_scores in zip(items, scores):
        lls = [s.logprob for s in item_scores]
        acc += _first_max(lls) == item.gold
        per_char = [ll / max(ending_length(cont), 1) for ll, (_, cont) in zip(lls, item.requests)]
        acc_norm += _first_max(per_char) == item.gold
    out = {"acc": acc / len(items)}
    if kind != PARTIAL:
        out["acc_norm"] = acc_norm / len(items)
    return out
