"""Data pipeline throughput per rank, against the bare tokenizer on the same documents.

Every data-parallel rank packs the whole token stream and keeps its slice of each global batch, so a
rank's throughput is the pipeline's. This measures, in one run:

- startup: opening the stream (`datasets.load_dataset(..., streaming=True)`) and the first batch;
- pipeline tokens/s of one rank (dp=1, and the last rank of a larger dp: the same work);
- baseline tokens/s: the GPT-2 tokenizer alone on the same files read straight from disk.

    python -m bench.data                       # stdlib source, seq_len 1024, 8M tokens, best of 3
    python -m bench.data --seq-len 2048 --dp 8 --max-tokens 5e6
"""

from __future__ import annotations

import argparse
import time

from train.data import TrainBatches
from train.data_sources import open_stream, resolve
from train.tokenizer import gpt2


def pipeline_rate(cfg: dict, seq_len: int, global_batch: int, dp_rank: int, dp: int, max_tokens: int):
    """(seconds to the first batch, stream tokens packed per second after it) for one rank."""
    start = time.perf_counter()
    batches = TrainBatches(cfg, seq_len, global_batch, dp_rank, dp, seed=0)
    next(batches)
    first = time.perf_counter() - start
    served, start = batches.windows_served, time.perf_counter()
    while (batches.windows_served - served) * (seq_len + 1) < max_tokens:
        next(batches)
    tokens = (batches.windows_served - served) * (seq_len + 1)
    return first, tokens / (time.perf_counter() - start)


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
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--dp", type=int, default=8, help="data-parallel size for the second measurement")
    parser.add_argument("--shuffle-buffer", type=int, default=256)
    parser.add_argument("--max-tokens", type=float, default=8e6, help="tokens per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each; the best is kept (noisy hosts)")
    args = parser.parse_args()
    cfg = {"source": "stdlib", "shuffle_buffer": args.shuffle_buffer, "val_permille": 10}
    max_tokens = int(args.max_tokens)

    spec = resolve(cfg)
    gpt2()  # build the tokenizer outside the timings
    start = time.perf_counter()
    open_stream(spec)
    opened = time.perf_counter() - start
    start = time.perf_counter()
    open_stream(spec)
    reopened = time.perf_counter() - start
    print(f"stdlib: {len(spec.files)} files; load_dataset(streaming) {opened:.2f} s first, {reopened:.2f} s again")

    base = max(tokenizer_rate(spec.files, max_tokens) for _ in range(args.repeats))
    print(f"baseline  tokenizer alone         {base / 1e6:7.2f} M tokens/s")
    for rank, dp in ((0, 1), (args.dp - 1, args.dp)):
        runs = [pipeline_rate(cfg, args.seq_len, args.global_batch, rank, dp, max_tokens) for _ in range(args.repeats)]
        first, rate = min(r[0] for r in runs), max(r[1] for r in runs)
        print(
            f"pipeline  rank {rank} of dp={dp:<3}        {rate / 1e6:7.2f} M tokens/s per rank "
            f"({rate / base:.2f}× baseline); first batch after {first:.2f} s"
        )


if __name__ == "__main__":
    main()
