"""Attention benchmark: one table per run, every ratio against a baseline measured in the same run.

  python -m bench.attention           # CUDA when available, else CPU
  python -m bench.attention --quick   # small sizes: a smoke run (under a minute on CPU)
  python -m bench.attention --cpu     # the CPU benchmark on a machine with a GPU

CUDA, bf16: impl="triton" against each torch SDPA backend (flash, efficient, cudnn, math; any that
fails is skipped), causal, d = 64 and 128; the banded kernel (window 256) against the dense one;
peak memory against impl="reference".
CPU, float32: impl="torch" (and its banded form) against impl="reference"; each case's peak
resident memory and its timings are measured in fresh subprocesses (see bench/README.md), times
are the minimum over repetitions (the least disturbed by other load on the machine).

FLOPs count the visible (query, key) pairs exactly: forward 4·B·H·D·pairs (two matmuls), backward
2.5× that (five matmuls); causal pairs = T(T+1)/2 ≈ T²/2, banded ≈ T·w. speed× = the baseline's
forward+backward time / this row's (above 1: faster); mem× = this row's peak / the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from model.attention import attention

SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def attention_flops(shape, window: int | None, backward: bool) -> float:
    """FLOPs of causal attention (optionally banded) over the (query, key) pairs it lets through."""
    b, h, t, d = shape
    pairs = sum(i + 1 if window is None else min(i + 1, window) for i in range(t))
    fwd = 4.0 * b * h * d * pairs
    return fwd * 3.5 if backward else fwd


def make_inputs(shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))  # (B, H, T, D)
    return [x.requires_grad_() for x in (q, k, v)], do


def attention_fn(impl, window):
    """fn(q, k, v) for an impl name: "triton", "torch", "reference" or "sdpa-<BACKEND>" (causal)."""
    if not impl.startswith("sdpa-"):
        return lambda q, k, v: attention(q, k, v, causal=True, window=window, impl=impl)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, impl.removeprefix("sdpa-"))

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


# ---------------------------------------------------------------- CUDA: one process
def cuda_case(impl, shape, window):
    """{fwd_ms, fb_ms, peak_mib} for one impl on bf16 CUDA inputs, or None if the impl cannot run."""
    from triton.testing import do_bench

    fn = attention_fn(impl, window)
    ins, do = make_inputs(shape, torch.bfloat16, "cuda")
    try:
        fn(*ins).backward(do)
    except (RuntimeError, NotImplementedError) as err:  # an SDPA backend unsupported on this GPU/shape/dtype
        print(f"skip {impl}: {str(err).splitlines()[0]}", file=sys.stderr)
        return None
    for x in ins:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*ins).backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    with torch.no_grad():
        fwd_ms = do_bench(lambda: fn(*ins), return_mode="median")
    fb_ms = do_bench(lambda: fn(*ins).backward(do), grad_to_none=ins, return_mode="median")
    return {"fwd_ms": fwd_ms, "fb_ms": fb_ms, "peak_mib": peak / 2**20}


def cuda_rows(quick):
    b, t = (2, 512) if quick else (8, 2048)
    rows = []
    for d in (64, 128):
        shape = (b, 2048 // d, t, d)
        group = f"T={t} d={d} causal"
        cases = {impl: cuda_case(impl, shape, None) for impl in ("triton", *(f"sdpa-{n}" for n in SDPA_BACKENDS))}
        cases = {impl: r for impl, r in cases.items() if r is not None}
        sdpa = [impl for impl in cases if impl.startswith("sdpa-")]
        baseline = min(sdpa, key=lambda impl: cases[impl]["fb_ms"]) if sdpa else "triton"
        rows += [dict(group=group, impl=impl, shape=shape, window=None, baseline=impl == baseline, **r)
                 for impl, r in cases.items()]
    shape = (b, 16, t, 128)
    rows.append(dict(group=f"T={t} d=128 banded", impl="triton", shape=shape, window=None, baseline=True,
                     **cuda_case("triton", shape, None)))
    rows.append(dict(group=f"T={t} d=128 banded", impl="triton w=256", shape=shape, window=256, baseline=False,
                     **cuda_case("triton", shape, 256)))
    for impl in ("reference", "triton"):
        rows.append(dict(group=f"T={t} d=128 memory", impl=impl, shape=shape, window=None,
                         baseline=impl == "reference", **cuda_case(impl, shape, None)))
    return rows


# ---------------------------------------------------------------- CPU: fresh subprocesses per case
def _rss_kib(field):
    """VmRSS (current) or VmHWM (peak since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_worker(job):
    """Runs in a fresh process: the peak resident memory of one forward+backward, or its timings."""
    torch.set_num_threads(job["threads"])
    fn = attention_fn(job["impl"], job["window"])
    ins, do = make_inputs(tuple(job["shape"]), torch.float32, "cpu")
    fn(*ins).backward(do)  # warm-up: one-time allocations (thread pools, ...) are not the case's memory
    for x in ins:
        x.grad = None
    if job["measure"] == "memory":
        before = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        fn(*ins).backward(do)
        return {"peak_mib": (_rss_kib("VmHWM") - before) / 1024}
    fwd, fb = [], []
    for _ in range(job["reps"]):
        start = time.perf_counter()
        out = fn(*ins)
        fwd.append(time.perf_counter() - start)
        out.backward(do)
        fb.append(time.perf_counter() - start)
        for x in ins:
            x.grad = None
    return {"fwd_ms": 1e3 * min(fwd), "fb_ms": 1e3 * min(fb)}


def cpu_case(impl, shape, window, reps, threads):
    """Memory and timings of one case, each measured in a fresh subprocess."""
    result = {}
    for measure in ("memory", "time"):
        job = dict(impl=impl.split()[0], shape=shape, window=window, reps=reps, threads=threads, measure=measure)
        env = dict(os.environ)
        if measure == "memory":
            # A fixed mmap threshold makes glibc hand every freed block of 64 KiB or more back to the
            # OS at once, so memory freed by the warm-up cannot be silently reused and hide from the
            # peak. (It slows allocation, hence the separate process for timings.)
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        out = subprocess.run([sys.executable, "-m", "bench.attention", "--worker", json.dumps(job)], env=env,
                             check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        result.update(json.loads(out.stdout.splitlines()[-1]))
    return result


def cpu_rows(quick, threads):
    lengths, reps = ((256, 512), 3) if quick else ((1024, 2048), 7)
    rows = []
    for t in lengths:
        shape = (1, 12, t, 64)
        for impl, window in (("reference", None), ("torch", None), ("torch w=256", 256)):
            rows.append(dict(group=f"T={t} d=64 causal", impl=impl, shape=shape, window=window,
                             baseline=impl == "reference", **cpu_case(impl, shape, window, reps, threads)))
    return rows


# ---------------------------------------------------------------- the table
def print_table(rows, device, unit):
    """One line per case; speed× = baseline time / time (fwd+bwd), mem× = peak / baseline peak.
    unit: "TF" or "GF", the FLOP/s scale of the FLOP/s columns."""
    scale = {"TF": 1e9, "GF": 1e6}[unit]  # FLOPs per ms
    head = (f"{'case':<22} {'impl':<24} {'fwd ms':>9} {f'fwd {unit}/s':>9} {'f+b ms':>9} {f'f+b {unit}/s':>9} "
            f"{'peak MiB':>9} {'speed×':>7} {'mem×':>6}")
    print(f"attention benchmark on {device}; ratios against the row marked * in each case")
    print(head)
    print("-" * len(head))
    for row in rows:
        base = next(r for r in rows if r["group"] == row["group"] and r["baseline"])
        fwd_tf = attention_flops(row["shape"], row["window"], False) / row["fwd_ms"] / scale
        fb_tf = attention_flops(row["shape"], row["window"], True) / row["fb_ms"] / scale
        name = row["impl"] + (" *" if row["baseline"] else "")
        print(f"{row['group']:<22} {name:<24} {row['fwd_ms']:>9.2f} {fwd_tf:>9.2f} {row['fb_ms']:>9.2f} "
              f"{fb_tf:>9.2f} {row['peak_mib']:>9.1f} {base['fb_ms'] / row['fb_ms']:>7.2f} "
              f"{row['peak_mib'] / base['peak_mib']:>6.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--cpu", action="store_true", help="the CPU benchmark even when CUDA is available")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads per case")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one CPU case, as JSON
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(cpu_worker(json.loads(args.worker))))
        return
    if torch.cuda.is_available() and not args.cpu:
        print_table(cuda_rows(args.quick), f"{torch.cuda.get_device_name()}, bfloat16", "TF")
    else:
        print_table(cpu_rows(args.quick, args.threads), f"CPU, {args.threads} thread(s), float32", "GF")


if __name__ == "__main__":
    main()
