"""What one data-parallel rank can supply, against what it must supply to keep a GPU busy.

For simulated dp = 1, 8, 64 (one rank of each, on this machine) and data.streams = 64, it measures the
wall time a rank spends producing its rows of one global batch (after the first batch: opening and
filling the first shuffle chunks is startup) and reports, in one run:

- ``work/batch``: that time; ``vs dp=1``: its ratio to the dp=1 row with the same workers (ideal 1/dp);
- ``supplies``: the tokens per second this rank hands to its GPU (its rows: global batch / dp windows of
  seq_len trained tokens, per that time);
- ``supply/demand``: supplies ÷ the assumed demand of one GPU (below);
- the same with background workers (``data.workers``), and, for reference, the old layout
  (``data.streams=1``: every rank packs the whole stream and keeps 1/dp of it);
- baseline: the GPT-2 tokenizer alone on the same files, one thread, read straight from disk.

Demand: one H100 training gpt3-125m (seq 2048). gpt3-125m costs 6N + 12·L·d·T FLOPs per trained token
(PaLM's count, as the training loop's MFU uses); at 45% MFU of the H100's 989 TFLOP/s dense bf16 peak
that is about 0.46M tokens/s — inside the 0.4–0.5M tokens/s that such runs reach. Every rank must
supply that whatever dp is, since each rank feeds its own GPU.

    python -m bench.data                 # seq 2048, global batch 64, streams 64, dp 1/8/64, workers 0 and 2
    python -m bench.data --quick         # a smoke run: seq 256, streams 4, dp 1/2/4, under a minute
    python -m bench.data --paths /data/owt/*.jsonl   # on your own corpus (tokens/s depend on the text)
"""

from __future__ import annotations

import argparse
import os
import time

from train.data import TrainBatches
from train.data.sources import resolve
from train.data.tokenizer import gpt2

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM
ASSUMED_MFU = 0.45


def demand_tokens_per_s() -> tuple[float, float]:
    """(tokens/s one H100 trains gpt3-125m at ASSUMED_MFU, FLOPs per token)."""
    import torch

    from model import GPT, GPTConfig, count_parameters, flops_per_token

    cfg = GPTConfig.from_dict({"name": "gpt3-125m", "n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 2048})
    with torch.device("meta"):
        model = GPT(cfg)
    flops = flops_per_token(count_parameters(model, exclude_positions=True), cfg.n_layer, cfg.d_model, cfg.seq_len)
    return ASSUMED_MFU * H100_BF16_TFLOPS * 1e12 / flops, flops


def rank_seconds_per_batch(cfg: dict, seq_len: int, batch: int, dp: int, seconds: float) -> float:
    """Seconds rank dp-1 of dp spends on its rows of one global batch, after the first batch."""
    it = TrainBatches(cfg, seq_len, batch, dp - 1, dp, seed=0, warn=False)
    try:
        next(it)
        n, start = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - start < seconds:
            next(it)
            n += 1
        return (time.perf_counter() - start) / n
    finally:
        it.close()


def tokenizer_rate(files: tuple[str, ...], max_tokens: int) -> float:
    """Tokens per second of encode_ordinary alone over the files, read straight from disk."""
    enc, tokens, start = gpt2(), 0, time.perf_counter()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            tokens += len(enc.encode_ordinary(f.read())) + 1
        if tokens >= max_tokens:
            break
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64, help="windows per global batch (a multiple of --streams)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--workers", type=int, default=2, help="background workers for the second set of rows")
    parser.add_argument("--chunk", type=int, default=4, help="windows each stream shuffles together")
    parser.add_argument("--seconds", type=float, default=5.0, help="minimum measuring time per row")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per row; the fastest is kept (busy hosts)")
    parser.add_argument("--paths", nargs="+", help="measure on these files (data=files) instead of the stdlib corpus")
    parser.add_argument("--quick", action="store_true", help="seq 256, batch 8, streams 4, dp 1 2 4, 0.5 s per row")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.global_batch, args.streams, args.dp, args.seconds, args.repeats = 256, 8, 4, [1, 2, 4], 0.5, 1

    demand, flops = demand_tokens_per_s()
    source = {"source": "files", "paths": args.paths} if args.paths else {"source": "stdlib"}
    base_cfg = {**source, "val_permille": 10, "streams": args.streams, "shuffle_buffer": args.streams * args.chunk}
    gpt2()  # built outside the timings
    base = tokenizer_rate(resolve(base_cfg).sources[0].files, 4_000_000)
    print(f"demand per rank: {demand:,.0f} tokens/s = one H100 training gpt3-125m ({flops / 1e9:.2f} GFLOP/token "
          f"at {ASSUMED_MFU:.0%} MFU of {H100_BF16_TFLOPS:.0f} TFLOP/s bf16)")
    print(f"baseline: GPT-2 tokenizer alone, one thread: {base:,.0f} tokens/s")
    print(f"{'files' if args.paths else 'stdlib'} corpus, seq_len {args.seq_len}, global batch {args.global_batch} windows "
          f"({args.global_batch * args.seq_len:,} tokens); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"fastest of {args.repeats} per row")
    header = f"{'streams':>7} {'dp':>4} {'workers':>7} {'work/batch s':>12} {'vs dp=1':>8} {'ideal':>6} " \
             f"{'supplies tok/s':>15} {'supply/demand':>13}"
    print(header)
    print("-" * len(header))
    cases = [(args.streams, dp, w) for w in (0, args.workers) for dp in args.dp]
    cases += [(1, dp, 0) for dp in args.dp if dp > 1][:1]  # the old layout, for reference
    first = {}
    for streams, dp, workers in cases:
        cfg = {**base_cfg, "streams": streams, "shuffle_buffer": args.streams * args.chunk, "workers": workers}
        t = min(rank_seconds_per_batch(cfg, args.seq_len, args.global_batch, dp, args.seconds) for _ in range(args.repeats))
        first.setdefault((streams, workers), t if dp == 1 else None)
        reference = first[(streams, workers)] or first.get((args.streams, 0))
        supplies = args.global_batch // dp * args.seq_len / t
        ideal = f"{1 / dp:.3f}" if streams > 1 else "-"  # the old layout does the same work at every dp
        print(f"{streams:>7} {dp:>4} {workers:>7} {t:>12.4f} {t / reference:>8.3f} {ideal:>6} "
              f"{supplies:>15,.0f} {supplies / demand:>13.2f}")


if __name__ == "__main__":
    main()
