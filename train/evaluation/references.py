"""The GPT-3 paper's zero-shot figures for gpt3d's tasks, per model size (Brown et al. 2020, Table H.1).

Table H.1 ("Scores for every task, setting and model") lists, for each of the eight sizes, the
zero-, one- and few-shot results; these are its zero-shot ones, in percent (ppl: LAMBADA's
perplexity), checked row by row against Table H.1 of arXiv 2005.14165v4. Its splits: LAMBADA,
StoryCloze and ARC on the test set; HellaSwag, PIQA, Winogrande and COPA on the dev set.
The 175B column agrees with Tables 3.2 (LAMBADA acc and ppl, StoryCloze, HellaSwag), 3.5
(Winogrande) and 3.6 (ARC Easy and Challenge). Two exceptions: Table 3.6 prints 80.5 for PIQA
zero-shot, where Table H.1 and the text of section 3.5 give 81.0 (kept here); and Table 3.8 holds
only few-shot SuperGLUE test-set scores, so COPA's zero-shot 91.0 (dev) is in Table H.1 alone.
The paper used its own prompts and normalisations (docs/evaluation.md), so a figure here is a
yardstick, not an exact target.
"""

from __future__ import annotations

SIZES = ("125M", "350M", "760M", "1.3B", "2.7B", "6.7B", "13B", "175B")
# (n_layer, d_model) of each size (Table 2.1; configs/model/gpt3-*.yaml)
SHAPES = {(12, 768): "125M", (24, 1024): "350M", (24, 1536): "760M", (24, 2048): "1.3B", (32, 2560): "2.7B",
          (32, 4096): "6.7B", (40, 5120): "13B", (96, 12288): "175B"}

ZERO_SHOT = {  # (task, metric) → one figure per size, in SIZES' order
    ("lambada", "acc"): (42.7, 54.3, 60.4, 63.6, 67.1, 70.3, 72.5, 76.2),
    ("lambada", "ppl"): (18.6, 9.09, 6.53, 5.44, 4.60, 4.00, 3.56, 3.00),
    ("storycloze", "acc"): (63.3, 68.5, 72.4, 73.4, 77.2, 77.7, 79.5, 83.2),
    ("hellaswag", "acc"): (33.7, 43.6, 51.0, 54.7, 62.8, 67.4, 70.9, 78.9),
    ("piqa", "acc"): (64.6, 70.2, 72.9, 75.1, 75.6, 78.0, 78.5, 81.0),
    ("arc_challenge", "acc"): (26.6, 29.5, 31.8, 35.5, 38.0, 41.4, 43.7, 51.4),
    ("arc_easy", "acc"): (43.6, 46.5, 53.0, 53.8, 58.2, 60.2, 63.8, 68.8),
    ("winogrande", "acc"): (52.0, 52.1, 57.4, 58.7, 62.3, 64.5, 67.9, 70.2),
    ("copa", "acc"): (66.0, 68.0, 73.0, 77.0, 76.0, 80.0, 84.0, 91.0),
}
TABLE = "Brown et al. 2020, Table H.1, zero-shot"


def paper_size(n_layer: int, d_model: int) -> str | None:
    """The paper's name of a model of this shape, or None for a shape the paper did not train."""
    return SHAPES.get((n_layer, d_model))


def reference(task: str, metric: str, size: str | None) -> float | None:
    """The paper's zero-shot figure (acc in percent, ppl as is) for this task, metric and size, if any."""
    figures = ZERO_SHOT.get((task, metric))
    return None if figures is None or size is None else figures[SIZES.index(size)]
