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
- baseline: the GPT-2 tokenizer alone on the same files, one thread, read straight from disk;
- Hub-style rows (``hub``): the same documents written as a local dataset folder of parquet files
  (``--hub-files`` of them, 4 per stream by default) and read through ``data.source=hub``, as a
  `datasets` stream of a Hub dataset is: per simulated rank, the bytes it reads (Linux's count of
  the process's reads, /proc/self/io ``rchar``) while serving ``--hub-batches`` global batches (by
  default as many as take each stream half way into its second file), its ratio to dp=1 against the
  ideal 1/dp and their quotient (``÷ ideal``, 1 at perfect scaling), and the tokens per second it
  supplies (after the first batch).

Demand: one H100 training gpt3-125m (seq 2048). gpt3-125m costs 6N + 12·L·d·T FLOPs per trained token
(PaLM's count, as the training loop's MFU uses); at 45% MFU of the H100's 989 TFLOP/s dense bf16 peak
that is about 0.46M tokens/s — inside the 0.4–0.5M tokens/s that such runs reach. Every rank must
supply that whatever dp is, since each rank feeds its own GPU.

    python -m bench.data                 # seq 2048, global batch 64, streams 64, dp 1/8/64, workers 0 and 2
    python -m bench.data --quick         # a smoke run: seq 256, streams 4, dp 1/2/4, under a minute
    python -m bench.data --paths /data/owt/*.jsonl   # on your own corpus (tokens/s depend on the text)
    python -m bench.data --hub-only      # only the Hub-style rows
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from train.data import TrainBatches
from train.data.sources import resolve
from train.data.tokenizer import gpt2

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM
ASSUMED_MFU = 0.45
HUB_RECORD_CHARS = 4000  # the Hub-style rows' records: pieces of the corpus's documents
HUB_ROW_GROUP = 2  # records per parquet row group (the unit a reader reads)


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


def hub_folder(folder: str, documents: tuple[str, ...], n_files: int, bytes_per_file: int) -> str:
    """A local dataset folder as `datasets` reads a Hub dataset: n_files parquet files of about bytes_per_file
    bytes of text each and a dataset card naming the features (so opening it reads no data file). The text is
    the documents' cut into records of HUB_RECORD_CHARS characters, dealt to the files in turn, so the files
    are alike and every stream reads about the same bytes per token; row groups of HUB_ROW_GROUP records keep
    the reads fine-grained. Returns the folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[list[str]] = [[] for _ in range(n_files)]
    size, k, n = 0, 0, 0
    while size < n_files * bytes_per_file:
        with open(documents[k % len(documents)], encoding="utf-8", errors="replace") as f:
            text = f.read()
        for start in range(0, len(text), HUB_RECORD_CHARS):
            rows[n % n_files].append(text[start : start + HUB_RECORD_CHARS])
            n += 1
        size, k = size + len(text.encode()), k + 1
    for i, records in enumerate(rows):
        pq.write_table(pa.table({"text": records}), os.path.join(folder, f"train-{i:05d}.parquet"),
                       row_group_size=HUB_ROW_GROUP, write_statistics=False)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("---\ndataset_info:\n  features:\n  - name: text\n    dtype: string\n---\n")
    return folder


def bytes_read() -> int:
    """Bytes this process has read so far through read system calls (Linux: /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def hub_rank(cfg: dict, seq_len: int, batch: int, dp: int, batches: int) -> tuple[int, float]:
    """(bytes read, tokens/s supplied) of rank dp-1 of dp serving `batches` global batches from a hub source:
    bytes from the start (opening the dataset included), time after the first batch."""
    start_bytes = bytes_read()
    it = TrainBatches(cfg, seq_len, batch, dp - 1, dp, seed=0, warn=False)
    try:
        next(it)
        start = time.perf_counter()
        for _ in range(batches - 1):
            next(it)
        seconds = time.perf_counter() - start
    finally:
        it.close()
    return bytes_read() - start_bytes, (batches - 1) * (batch // dp) * seq_len / seconds


def _batches_for(files: float, folder: str, seq_len: int, per_stream: int) -> int:
    """Global batches in which each stream reads about `files` files (counted on the first file's tokens).
    A reader reads whole files, so a count of bytes taken just as streams open their next file would measure
    where that boundary falls, not how reading scales with dp: the default count stops half way into a file."""
    import pyarrow.parquet as pq

    enc = gpt2()
    texts = pq.read_table(os.path.join(folder, "train-00000.parquet")).column("text").to_pylist()
    tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in texts)
    return max(2, round(files * tokens / (seq_len + 1) / per_stream))


def hub_rows(args, documents: tuple[str, ...], demand: float) -> None:
    """The Hub-style rows: per-rank bytes read and tokens/s at each dp, against dp=1 and the ideal 1/dp."""
    n_files = args.hub_files or 4 * args.streams
    with tempfile.TemporaryDirectory(prefix="gpt3d-bench-hub-") as folder:
        hub_folder(folder, documents, n_files, args.hub_file_kb * 1024)
        batches = args.hub_batches or _batches_for(1.5, folder, args.seq_len, args.global_batch // args.streams)
        cfg = {"source": "hub", "name": folder, "val_permille": 10, "streams": args.streams,
               "shuffle_buffer": args.streams * args.chunk}
        hub_rank(cfg, args.seq_len, args.global_batch, args.dp[-1], 2)  # imports and first opens outside the counts
        print(f"\nhub-style: a local folder of {n_files} parquet files ({n_files * args.hub_file_kb / 1024:,.1f} MB of "
              f"text) through data.source=hub, {args.streams} streams ({n_files / args.streams:g} files each), "
              f"{batches} global batches per rank")
        header = f"{'':>3} {'streams':>7} {'dp':>4} {'MB read':>9} {'vs dp=1':>8} {'ideal':>6} {'÷ ideal':>7} " \
                 f"{'supplies tok/s':>15} {'supply/demand':>13}"
        print(header)
        print("-" * len(header))
        first = None
        for dp in args.dp:
            got, rate = hub_rank(cfg, args.seq_len, args.global_batch, dp, batches)
            first = first or got
            print(f"{'hub':>3} {args.streams:>7} {dp:>4} {got / 2**20:>9.2f} {got / first:>8.4f} {1 / dp:>6.4f} "
                  f"{got / first * dp:>7.3f} {rate:>15,.0f} {rate / demand:>13.2f}")


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
    parser.add_argument("--hub-only", action="store_true", help="only the Hub-style rows")
    parser.add_argument("--hub-files", type=int, help="parquet files of the Hub-style rows (default: 4 per stream)")
    parser.add_argument("--hub-file-kb", type=int, default=128, help="kilobytes of text per parquet file")
    parser.add_argument("--hub-batches", type=int,
                        help="global batches each Hub-style rank serves (default: its streams read 1.5 files each)")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.global_batch, args.streams, args.dp, args.seconds, args.repeats = 256, 8, 4, [1, 2, 4], 0.5, 1
        args.hub_file_kb = 16

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
    if args.hub_only:
        return hub_rows(args, resolve(base_cfg).sources[0].files, demand)
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
    hub_rows(args, resolve(base_cfg).sources[0].files, demand)


if __name__ == "__main__":
    main()
