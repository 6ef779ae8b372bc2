"""Generation speed with the KV cache against re-encoding the context every token.

    python -m bench.generate                 # 1,024-token context, 32 new tokens, the toy's shape
    python -m bench.generate --quick         # 256-token context, 16 new tokens: a smoke run
    python -m bench.generate --layers 12 --d-model 768 --heads 12 --device cuda

One model, one prompt of `context` tokens, greedy decoding of `new` tokens in both modes in the
same run; the baseline (*) is the uncached mode, which runs the whole context (≤ seq_len =
context + new tokens) through the model for every token. Columns: `tokens/s` and `ms/token` end
to end (encoding the prompt included); `step ms` the cost of one more token once the prompt is
in, (t(new) − t(1)) / (new − 1); `speed×` and `step×` the baseline's time over the row's. Each
timing is the median of `--repeats` runs after one warm-up. Both modes must produce the same
tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import GPTConfig, build, generate


def measure(model, prompt: torch.Tensor, new: int, use_cache: bool, repeats: int, sync) -> tuple[float, torch.Tensor]:
    """Median seconds of one greedy generation of `new` tokens, and the tokens it produced."""
    out = generate(model, prompt, new, temperature=0, use_cache=use_cache)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = generate(model, prompt, new, temperature=0, use_cache=use_cache)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def step_seconds(model, prompt, new, use_cache, repeats, sync, total: float) -> float:
    """Seconds per token after the first: (t(new) − t(1)) / (new − 1)."""
    first, _ = measure(model, prompt, 1, use_cache, repeats, sync)
    return (total - first) / (new - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256-token context, 16 new tokens")
    parser.add_argument("--context", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens to generate")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--pattern", default="dense", choices=["dense", "alternating"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.quick:
        args.context, args.new, args.repeats = 256, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = GPTConfig(name="bench", n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                       seq_len=args.context + args.new, attention_pattern=args.pattern, local_window=256)
    model = build(config, device, seed=0).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    if args.new < 2:
        raise SystemExit(f"--new={args.new}: needs at least 2 tokens")
    rows = {}
    for name, use_cache in (("uncached *", False), ("cached", True)):
        total, out = measure(model, prompt, args.new, use_cache, args.repeats, sync)
        rows[name] = (total, step_seconds(model, prompt, args.new, use_cache, args.repeats, sync, total), out)
    (base_total, base_step, reference), (_, _, out) = rows["uncached *"], rows["cached"]
    if not torch.equal(out, reference):
        raise SystemExit("cached and uncached generation produced different tokens")

    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"greedy generation, GPT L={args.layers} d={args.d_model} H={args.heads} {args.pattern}: context "
          f"{args.context} tokens, {args.new} new, {device.type} float32{threads}, median of {args.repeats}")
    print(f"{'mode':<12}{'tokens/s':>10}{'ms/token':>10}{'speed×':>8}{'step ms':>10}{'step×':>8}")
    for name, (total, step, _) in rows.items():
        print(f"{name:<12}{args.new / total:>10.1f}{1000 * total / args.new:>10.2f}{base_total / total:>8.2f}"
              f"{1000 * step:>10.2f}{base_step / step:>8.2f}")


if __name__ == "__main__":
    main()
