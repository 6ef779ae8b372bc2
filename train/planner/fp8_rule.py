"""Which block linears compute in float8 under train.precision=fp8: those whose products are faster so.

A block linear y = x Wᵀ (x (N, k), W (n, k)) runs three products of 2·N·k·n FLOPs each, N the tokens of a
micro batch (micro batch × seq_len; a column-parallel layer under sequence parallelism multiplies its
gathered input), k and n this rank's in and out features (tensor parallelism: a column-parallel layer
holds n/tp outputs, a row-parallel one k/tp inputs):

    forward      (N × k)·(k × n)
    input grad   (N × n)·(n × k)
    weight grad  (n × N)·(N × k)

In float8 each product also casts its two operands (amax, scale, saturated cast, layout: model/float8.py).
`choose_fp8_linears` decides each linear by one rule:

  a measured table for the GPU (configs/plan/fp8/PRESET.json, PRESET its hardware preset; written by
  bench/fp8_products.py, the GPU suite's fp8-products section): for each product P of the linear, the
  table's row R nearest to P's shape (M, K, N) in log space, Σ (log₂(P_i / R_i))², gives the seconds
  per FLOP of torch.mm in bf16 and of the recipe's float8 product (its operands' casts plus
  torch._scaled_mm); at those rates P takes t_bf16(P) and t_fp8(P), and the linear computes in float8 iff

      Σ_P t_bf16(P) ≥ MIN_SPEEDUP · Σ_P t_fp8(P)

  no table for the GPU (or none of the recipe's): torchao's thresholds, those of its float8 filter
  (torchao.float8.float8_linear_utils._auto_filter_for_recipe, from torchao's H100 measurements), on W's
  shape (n, k) after sharding: both multiples of 16, and
      tensorwise  not (k ≤ 4096 and n ≤ 1024)
      rowwise     not (n ≤ 2048 or k ≤ 1024 or (n ≤ 4096 and k ≤ 2048))      (stricter)

Every block has the same four linears at the same shapes, so the choice is one per linear name, the
same in every block. train.fp8_linears=all or a list of names overrides the rule (the choice then says
so). The head (the tied unembedding, (N × d)·(d × Vp/tp) under vocab parallelism) is judged by the
same rule, and stays in bf16 whatever it says (HEAD_IN_BF16).

One function serves everyone who needs the choice: the run specification resolves it once per run
(train/run/spec.py: the build, the run's first lines and W&B's config read that), the planner at each
layout it predicts (train/planner/estimate.py), `python -m train.plan` shows it with the predicted gain
(train/planner/tables.py), and bench.shard picks its float8 linears by it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from model import GPTConfig
from model.modes import BLOCK_LINEARS
from model.vocab import padded_vocab_size
from train.config.entry import CONFIG_DIR
from train.config.sections.train import FP8_ALL, FP8_BY_RULE, FP8_RECIPES

TABLE_DIR = CONFIG_DIR / "plan" / "fp8"  # PRESET.json: the measured products of a hardware preset's GPU
HEAD = "head"
# A linear computes in float8 only where the table predicts it this much faster: smaller predicted gains are
# within the sweep's timing noise and what it does not time (the amax all-reduces under tensor parallelism).
MIN_SPEEDUP = 1.05
HEAD_IN_BF16 = ("its logits feed the softmax and the loss directly, and the loss's unembedding (fused and chunked, "
                "or vocab-parallel) has no float8 path")
COLUMN_PARALLEL = ("attn.qkv", "mlp.fc")  # their outputs are split over the tensor-parallel ranks; the rest, inputs


def linear_shapes(model_cfg: GPTConfig, tp: int = 1) -> dict[str, tuple[int, int]]:
    """{linear: (in features, out features) of this rank's shard} for the four block linears and the head."""
    d, f = model_cfg.d_model, model_cfg.d_ff
    return {"attn.qkv": (d, 3 * d // tp), "attn.proj": (d // tp, d), "mlp.fc": (d, f // tp), "mlp.proj": (f // tp, d),
            HEAD: (d, padded_vocab_size(model_cfg.vocab_size, tp) // tp)}


def products(tokens: int, in_features: int, out_features: int) -> tuple[tuple[int, int, int], ...]:
    """The (M, K, N) of a linear's three products (A (M, K) · B (K, N)): forward, input grad, weight grad."""
    n, k = out_features, in_features
    return (tokens, k, n), (tokens, n, k), (n, tokens, k)


def torchao_threshold(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether torchao's float8 filter converts a linear of weight (out, in) to float8 (module docstring)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


@dataclass(frozen=True)
class MeasuredProduct:
    """One product shape of the table: A (m, k) · B (k, n), seconds in bf16 (torch.mm) and per float8 recipe
    the seconds of torch._scaled_mm on the float8 operands and of the casts that make them from bf16."""

    m: int
    k: int
    n: int
    mm_s: float
    fp8: dict  # recipe → (scaled_mm_s, casts_s)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    def fp8_s(self, recipe: str) -> float:
        """The product in float8 from bf16 operands: their casts and _scaled_mm."""
        return sum(self.fp8[recipe])


@dataclass(frozen=True)
class ProductTable:
    """A GPU's measured products (bench/fp8_products.py): where they were measured, and the rows."""

    preset: str
    gpu: str
    rows: tuple
    measured: dict  # commit, date, command, how the casts ran
    path: str = ""  # where it was read from, as its lines name it

    def rows_of(self, recipe: str) -> list[MeasuredProduct]:
        return [r for r in self.rows if recipe in r.fp8]

    def speedup(self, recipe: str, tokens: int, in_features: int, out_features: int) -> float | None:
        """Σ t_bf16 / Σ t_fp8 over a linear's three products (module docstring); None without the recipe's rows."""
        rows = self.rows_of(recipe)
        if not rows:
            return None
        bf16 = fp8 = 0.0
        for shape in products(tokens, in_features, out_features):
            row = min(rows, key=lambda r: sum(math.log2(a / b) ** 2 for a, b in zip(shape, (r.m, r.k, r.n))))
            flops = 2 * math.prod(shape)
            bf16 += flops * row.mm_s / row.flops
            fp8 += flops * row.fp8_s(recipe) / row.flops
        return bf16 / fp8

    def describe(self) -> str:
        when = ", ".join(str(self.measured[key])[:10] for key in ("commit", "date") if self.measured.get(key))
        return f"the table measured on {self.gpu}{f' ({when})' if when else ''}, {self.path or self.preset}"


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)


def table_from_json(document: dict, where: str) -> ProductTable:
    """A ProductTable from its JSON form; ValueError, one line naming `where` and the bad entry."""
    if not isinstance(document, dict) or not isinstance(document.get("products"), list):
        raise ValueError(f"{where}: must be a JSON object with a list 'products'")
    rows = []
    for i, item in enumerate(document["products"]):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: products[{i}] must be an object with m, k, n, mm_s and a recipe's seconds")
        for key in ("m", "k", "n"):
            if not (isinstance(item.get(key), int) and not isinstance(item.get(key), bool) and item[key] > 0):
                raise ValueError(f"{where}: products[{i}].{key}={item.get(key)!r}: must be a positive integer")
        seconds = [("mm_s", item.get("mm_s"))]
        for recipe in (r for r in FP8_RECIPES if r in item):
            part = item[recipe] if isinstance(item[recipe], dict) else {}
            seconds += [(f"{recipe}.{key}", part.get(key)) for key in ("scaled_mm_s", "casts_s")]
        for key, value in seconds:
            if not _positive(value):
                raise ValueError(f"{where}: products[{i}].{key}={value!r}: must be a positive number of seconds")
        rows.append(MeasuredProduct(item["m"], item["k"], item["n"], float(item["mm_s"]),
                                    {r: (float(item[r]["scaled_mm_s"]), float(item[r]["casts_s"]))
                                     for r in FP8_RECIPES if r in item}))
    measured = {k: v for k, v in document.items() if k not in ("products", "preset", "gpu")}
    return ProductTable(str(document.get("preset", "")), str(document.get("gpu", "?")), tuple(rows), measured, where)


def load_table(path: Path, name: str | None = None) -> ProductTable:
    """The table in `path` (JSON), called `name` in what it says (default: the path); ValueError, one line
    naming it, when it cannot be read or is malformed."""
    name = name or str(path)
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{name}: not a readable JSON table of float8 products ({error})") from None
    return table_from_json(document, name)


def table_for(preset: str | None, directory: Path | None = None) -> ProductTable | None:
    """The committed table of hardware preset `preset` (None: no GPU) in `directory` (None: TABLE_DIR), or None
    when there is none."""
    if not preset:
        return None
    path = Path(directory if directory is not None else TABLE_DIR) / f"{preset}.json"
    return load_table(path, f"configs/plan/fp8/{preset}.json" if directory is None else None) if path.is_file() else None


@dataclass(frozen=True)
class LinearVerdict:
    """One linear: its shard's product shape, whether it computes in float8, what the rule says and why."""

    name: str
    tokens: int
    in_features: int
    out_features: int
    fp8: bool  # computes in float8 (the head: never)
    rule: bool  # what the rule says
    speedup: float | None  # the table's prediction (None: by torchao's thresholds)


@dataclass(frozen=True)
class Fp8Choice:
    """Which linears compute in float8 (`linears`, in BLOCK_LINEARS' order), by what, and each one's verdict."""

    recipe: str
    n_layer: int
    linears: tuple
    verdicts: tuple  # LinearVerdict of the four block linears, then the head
    basis: str

    @property
    def head(self) -> LinearVerdict:
        return self.verdicts[-1]

    def line(self) -> str:
        """One line: "fp8 tensorwise: 48 of 96 block linears in float8 (…), head in bf16, by …"."""
        rest = [name for name in BLOCK_LINEARS if name not in self.linears]
        if not rest:
            which = "all four"
        elif not self.linears:
            which = "none: every product computes as in bf16"
        else:
            which = f"{', '.join(self.linears)}; {', '.join(rest)} in bf16"
        return (f"fp8 {self.recipe}: {len(self.linears) * self.n_layer} of {len(BLOCK_LINEARS) * self.n_layer} "
                f"block linears in float8 ({which}), head in bf16, {self.basis}")

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe, "linears": list(self.linears), "block_linears_fp8": len(self.linears) * self.n_layer,
            "block_linears": len(BLOCK_LINEARS) * self.n_layer, "head": "bf16", "basis": self.basis,
            "shapes": {v.name: {"tokens": v.tokens, "in": v.in_features, "out": v.out_features,
                                "fp8": v.fp8, "rule": "fp8" if v.rule else "bf16", "predicted_speedup": v.speedup}
                       for v in self.verdicts},
        }


def choose_fp8_linears(model_cfg: GPTConfig, tp: int, micro_batch: int, recipe: str, setting=FP8_BY_RULE,
                       table: ProductTable | None = None, preset: str | None = None) -> Fp8Choice:
    """The choice for `model_cfg` at tensor-parallel degree `tp` with `micro_batch` sequences per micro batch,
    float8 recipe `recipe`, train.fp8_linears `setting` (auto: the rule; all; or a list of names) and the GPU's
    measured `table` (None: torchao's thresholds; `preset` names the GPU's hardware preset in the choice)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe!r}: must be one of {list(FP8_RECIPES)}")
    tokens = micro_batch * model_cfg.seq_len
    use_table = table is not None and bool(table.rows_of(recipe))
    shapes = linear_shapes(model_cfg, tp)
    speedups = {name: table.speedup(recipe, tokens, k, n) if use_table else None for name, (k, n) in shapes.items()}
    rule = {name: speedups[name] >= MIN_SPEEDUP if use_table else torchao_threshold(recipe, k, n)
            for name, (k, n) in shapes.items()}
    if setting == FP8_BY_RULE:
        chosen = tuple(name for name in BLOCK_LINEARS if rule[name])
        if use_table:
            basis = f"by {table.describe()}"
        elif table is not None:
            basis = f"by torchao's thresholds ({table.path} has no {recipe} rows)"
        elif preset:
            basis = f"by torchao's thresholds (no measured table configs/plan/fp8/{preset}.json yet)"
        else:
            basis = "by torchao's thresholds (no GPU here, so no measured table)"
    else:
        names = list(BLOCK_LINEARS) if setting == FP8_ALL else list(setting)
        chosen = tuple(name for name in BLOCK_LINEARS if name in names)
        basis = f"as train.fp8_linears={setting if setting == FP8_ALL else '[' + ','.join(names) + ']'} says"
    verdicts = tuple(LinearVerdict(name, tokens, k, n, name in chosen, rule[name], speedups[name])
                     for name, (k, n) in shapes.items())
    return Fp8Choice(recipe, model_cfg.n_layer, chosen, verdicts, basis)


def choice_for(model_cfg: GPTConfig, tp: int, micro_batch: int, recipe: str, setting=FP8_BY_RULE,
               preset: str | None = None) -> Fp8Choice:
    """choose_fp8_linears with the committed table of hardware preset `preset` (None: no GPU, no table)."""
    return choose_fp8_linears(model_cfg, tp, micro_batch, recipe, setting, table_for(preset), preset)


def linears_at(model_cfg: GPTConfig, layout, implementation, hardware) -> tuple[str, ...]:
    """The block linears the planner times in float8 at `layout` (train/planner/estimate.py's Layout) for an
    Implementation on Hardware: none without fp8; a run's resolved names; else train.fp8_linears by the rule
    for this layout's shapes and the GPU's table."""
    if implementation.fp8 is None:
        return ()
    if isinstance(implementation.fp8_linears, tuple):
        return implementation.fp8_linears
    return choice_for(model_cfg, layout.tp, layout.micro_batch, implementation.fp8, implementation.fp8_linears,
                      hardware.preset).linears
