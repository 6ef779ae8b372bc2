"""GPT-3's block-linear products in float8 against bf16, by shape: the table the fp8 rule reads.

  python -m bench.fp8_products                          # on a GPU: writes configs/plan/fp8/<its preset>.json
  python -m bench.fp8_products --cases gpt3-1.3b:1:2 --out /tmp/products.json
  python -m bench.fp8_products --device cpu --cases toy:1:1 --seq-len 32 --no-head --out /tmp/t.json   # CPU smoke

A case is MODEL:TP:MICRO (configs/model/MODEL.yaml at tensor-parallel degree TP, MICRO sequences per micro
batch). For every case, the three products of each of its block linears and of its head (--no-head: the block
linears only; the head stays bf16 in any run, the rule's word on it is for the record) at this rank's shard
(train/planner/fp8_rule.py: `linear_shapes`, `products`), deduplicated, are timed on the same bf16 operands
A (M, K) and B (K, N) of random values:

  mm                 torch.mm(A, B) in bf16: what the linear runs without float8
  per recipe (train.fp8_recipe: tensorwise, rowwise), the code training runs (model/float8.py's Float8Matmuls,
  its forward's casts: A as x, B as Wᵀ):
    casts_s          A's and B's amaxes, scales and saturated casts to float8, B̂ column-major; on a GPU
                     compiled once with dynamic shapes, as the compiled blocks run them (eager where
                     torch.compile fails, and the table says so)
    scaled_mm_s      torch._scaled_mm on those operands (through torchao's addmm_float8_unwrapped)

Each time is the median of --iterations after --warmup, by CUDA events on a GPU, wall time on a CPU. The
table (JSON: the GPU, its hardware preset, the commit, date and command, how the casts ran, and one row per
shape) goes to --out, by default on a GPU to configs/plan/fp8/PRESET.json, the file the fp8 rule reads for
that GPU (commit it). --budget-s stops the sweep early (the GPU suite's section has 120 s): what was
measured is written, marked partial. The printed table gives each shape's speed × of float8 against bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.timing import call_seconds

CASES = ("gpt3-125m:1:8", "gpt3-350m:1:8", "gpt3-760m:1:8", "gpt3-1.3b:1:2", "gpt3-2.7b:1:2", "gpt3-6.7b:1:1",
         "gpt3-13b:2:1", "gpt3-175b:8:1")  # the sizes bench.train_speed and bench.shard time, at their layouts
RECIPES = ("tensorwise", "rowwise")


def parse_case(text: str) -> tuple[str, int, int]:
    """MODEL:TP:MICRO → (model, tp, micro batch); ValueError naming the case and the form."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise ValueError(f"case {text!r}: must be MODEL:TP:MICRO, e.g. gpt3-175b:8:1 (TP and MICRO positive integers)")
    return parts[0], int(parts[1]), int(parts[2])


def sweep_shapes(cases: list[tuple[str, int, int]], seq_len: int | None = None,
                 head: bool = True) -> list[tuple[int, int, int]]:
    """The (M, K, N) of every product of the cases' block linears (and heads), each once, in the cases' order."""
    from bench.train_speed import load_model_config
    from model import GPTConfig
    from train.planner.fp8_rule import HEAD, linear_shapes, products

    shapes: list[tuple[int, int, int]] = []
    for name, tp, micro in cases:
        values = load_model_config(name)
        config = GPTConfig.from_dict({**values, **({"seq_len": seq_len} if seq_len else {})})
        if config.n_head % tp or config.d_ff % tp:
            raise ValueError(f"case {name}:{tp}:{micro}: tp={tp} must divide the heads ({config.n_head}) and d_ff")
        for name, (in_features, out_features) in linear_shapes(config, tp).items():
            if name == HEAD and not head:
                continue
            for shape in products(micro * config.seq_len, in_features, out_features):
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


def timer(device: torch.device, iterations: int, warmup: int):
    """fn → its median seconds (CUDA events on a GPU, wall time on a CPU)."""
    def time_of(fn) -> float:
        return statistics.median(call_seconds(fn, device, iterations, warmup))
    return time_of


def recipe_products(recipe: str, device: torch.device):
    """(casts(a, b) → float8 operands, multiply(operands) → product) of `recipe`, as Float8Matmuls runs its
    forward; the casts compiled with dynamic shapes on a GPU (how: "compiled" or "eager (why)")."""
    from model.float8 import Float8Matmuls
    from model.modes import Float8

    matmuls = Float8Matmuls(Float8(recipe))
    configs = matmuls.forward_configs

    def casts(a, b):
        return matmuls.cast(a, b, configs, matmuls.amaxes(a, None, b, None, configs, "forward"))

    def multiply(operands):
        a8, scale_a, b8, scale_b = operands
        return matmuls.multiply(a8, scale_a, b8, scale_b, torch.bfloat16, configs[2].use_fast_accum)

    how = "eager"
    if device.type == "cuda":
        compiled = torch.compile(casts, dynamic=True)
        try:
            probe = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
            compiled(probe, probe.t().contiguous())
            casts, how = compiled, "compiled"
        except Exception as error:  # the toolchain failed: time the eager casts, and say so
            how = f"eager (torch.compile failed: {type(error).__name__})"
    return casts, multiply, how


def measure(shapes, device: torch.device, iterations: int, warmup: int, budget_s: float, out=sys.stdout):
    """(rows as the table's JSON holds them, how the casts ran per recipe, whether the budget cut the sweep)."""
    time_of = timer(device, iterations, warmup)
    start = time.perf_counter()
    kinds = {recipe: recipe_products(recipe, device) for recipe in RECIPES}
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows, partial = [], False
    print(f"{'M':>7} {'K':>7} {'N':>7} {'mm ms':>9}" + "".join(f" {r + ' ms':>14} {'×':>5}" for r in RECIPES), file=out)
    for m, k, n in shapes:
        if time.perf_counter() - start > budget_s:
            partial = True
            break
        a = torch.randn(m, k, generator=generator).to(device, torch.bfloat16)  # (M, K)
        b = (0.02 * torch.randn(n, k, generator=generator)).to(device, torch.bfloat16).t()  # (K, N), as Wᵀ is
        row = {"m": m, "k": k, "n": n, "mm_s": time_of(lambda: torch.mm(a, b))}
        for recipe, (casts, multiply, _) in kinds.items():
            operands = casts(a, b)
            row[recipe] = {"casts_s": time_of(lambda: casts(a, b)), "scaled_mm_s": time_of(lambda: multiply(operands))}
        rows.append(row)
        print(f"{m:>7} {k:>7} {n:>7} {row['mm_s'] * 1e3:>9.3f}" + "".join(
            f" {sum(row[r].values()) * 1e3:>14.3f} {row['mm_s'] / sum(row[r].values()):>5.2f}" for r in RECIPES),
            file=out, flush=True)
        del a, b
    return rows, {recipe: how for recipe, (_, _, how) in kinds.items()}, partial


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="MODEL:TP:MICRO,… (default: GPT-3's sizes as "
                                                                  "the benchmarks run them)")
    parser.add_argument("--seq-len", type=int, help="override the configs' context length")
    parser.add_argument("--no-head", action="store_true", help="the block linears' products only, not the head's")
    parser.add_argument("--out", type=Path, help="the table's JSON (default on a GPU: configs/plan/fp8/PRESET.json)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=100.0, help="stop measuring new shapes after this long")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    args = parser.parse_args(argv)
    if args.device is None:
        parser.error("no CUDA device: pass --device cpu (and --out) for a smoke run on the CPU")
    if args.iterations < 1 or args.warmup < 0 or args.budget_s <= 0:
        parser.error(f"--iterations {args.iterations} must be ≥ 1, --warmup {args.warmup} ≥ 0, --budget-s > 0")
    device = torch.device(args.device)
    try:
        shapes = sweep_shapes([parse_case(c) for c in args.cases.split(",")], args.seq_len, head=not args.no_head)
    except (ValueError, SystemExit) as error:
        parser.error(str(error))
    if device.type == "cuda":
        from train.planner.fp8_rule import TABLE_DIR
        from train.planner.hardware import preset_for_cuda_device

        preset, gpu = preset_for_cuda_device(device.index or 0), torch.cuda.get_device_name(device)
        path = args.out or TABLE_DIR / f"{preset}.json"
    else:
        if args.out is None:
            parser.error("--out is required on the CPU (its table is no GPU's)")
        preset, gpu, path = "", "CPU", args.out
    from bench.attention import git_commit
    from train.monitor.metrics import write_atomically
    from train.planner.fp8_rule import table_from_json

    print(f"{len(shapes)} product shapes of {args.cases} on {gpu}; bf16 mm against each recipe's casts + "
          f"_scaled_mm; median of {args.iterations} after {args.warmup}", file=out)
    rows, casts, partial = measure(shapes, device, args.iterations, args.warmup, args.budget_s, out)
    document = {"preset": preset, "gpu": gpu, "commit": git_commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "command": "python -m bench.fp8_products " + " ".join(argv if argv is not None else sys.argv[1:]),
                "torch": torch.__version__, "casts": casts, "iterations": args.iterations, "partial": partial,
                "products": rows}
    table_from_json(document, str(path))  # the rule reads what was written
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(path), json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}: {len(rows)} of {len(shapes)} shapes{' (the budget ran out: partial)' if partial else ''}; "
          f"casts {casts}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
