"""Attention benchmark: one table per run, every ratio against a baseline measured in the same run.

  python -m bench.attention           # CUDA when available, else CPU
  python -m bench.attention --quick   # small sizes: a smoke run (under a minute on CPU)
  python -m bench.attention --cpu     # the CPU benchmark on a machine with a GPU
  python -m bench.attention --smoke   # the GPU benchmark's code on the CPU at toy sizes, float32

GPU, bf16, B=8, H=16, T=2048, head dims 64, 80, 96, 128 (--quick: B=2, T=512, d 64 and 128):
  causal        impl="triton" and torch's scaled_dot_product_attention under each backend, forced
                one at a time with sdpa_kernel: sdpa-flash (the baseline), sdpa-cudnn, sdpa-efficient;
  window 256    impl="triton" banded, the same kernel dense causal, and each SDPA backend with the
                band as a boolean mask (sdpa-efficient, the one that takes any mask, is the baseline).
Before timing, each row's forward and gradients are checked against a float64 reference on the
first (batch, 2 heads) slice of its inputs (column `err`: max relative error; above 2e-2 the row
is reported as failed and not timed). A row whose backend refuses the case is printed with the
reason, never dropped. The rows of a case are timed alternately, round by round (forward under
no_grad, then forward+backward through torch.autograd.grad), so drifting clocks or a busy machine
affect them alike; times are medians over the rounds.
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
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from model.attention import attention, band_mask, reference_attention

SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-4}


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
    """fn(q, k, v), causal, for "triton", "torch", "reference" or an SDPA backend ("sdpa-flash", ...):
    SDPA gets is_causal without a window and the band as a boolean mask with one."""
    if impl not in SDPA_BACKENDS:
        return lambda q, k, v: attention(q, k, v, causal=True, window=window, impl=impl)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
    masks = {}  # built once per length and device, outside the timed calls

    def run(q, k, v):
        mask = None
        if window is not None:
            t = q.shape[-2]
            if (t, q.device) not in masks:
                masks[t, q.device] = band_mask(t, t, True, window, q.device)  # (T, T)
            mask = masks[t, q.device]
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    return run


def max_rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def check(fn, ins, do, window):
    """Max relative error of fn's O, dQ, dK, dV against float64 on the inputs' first (batch, 2 heads)."""
    part = [x.detach()[:1, :2].requires_grad_() for x in ins]
    out = fn(*part)
    grads = torch.autograd.grad(out, part, do[:1, :2])
    ref_in = [x.detach().double().requires_grad_() for x in part]
    ref = reference_attention(*ref_in, causal=True, window=window)
    ref_grads = torch.autograd.grad(ref, ref_in, do[:1, :2].double())
    return max(max_rel_err(x, r) for x, r in zip((out, *grads), (ref, *ref_grads)))


# ---------------------------------------------------------------- GPU table: one process
def gpu_cases(quick):
    """(case name, shape, [(row name, impl, window)], baseline row) for the GPU table."""
    b, t, dims = (2, 512, (64, 128)) if quick else (8, 2048, (64, 80, 96, 128))
    cases = []
    for d in dims:
        shape = (b, 16, t, d)
        cases.append((f"T={t} d={d} causal", shape,
                      [("triton", "triton", None), *((name, name, None) for name in SDPA_BACKENDS)], "sdpa-flash"))
        cases.append((f"T={t} d={d} window 256", shape,
                      [("triton w=256", "triton", 256), ("triton dense", "triton", None),
                       *((f"{name} w=256", name, 256) for name in SDPA_BACKENDS)], "sdpa-efficient w=256"))
    return cases


def smoke_cases():
    shape = (1, 2, 128, 64)
    return [("T=128 d=64 causal", shape, [("triton", "triton", None), ("torch", "torch", None),
                                          *((name, name, None) for name in SDPA_BACKENDS)], "torch"),
            ("T=128 d=64 window 32", shape,
             [("torch w=32", "torch", 32), ("sdpa-efficient w=32", "sdpa-efficient", 32)], "torch w=32")]


def _timer(device):
    """timer(f, n): mean milliseconds of n calls of f."""
    if device.type != "cuda":
        def timer(f, n):
            start = time.perf_counter()
            for _ in range(n):
                f()
            return 1e3 * (time.perf_counter() - start) / n
        return timer

    def timer(f, n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    return timer


def _peak_mib(fn, ins, do, device):
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(fn(*ins), ins, do)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(name, shape, rows, baseline, dtype, device, rounds, inner):
    """Check each row, then time the rows that passed alternately; returns result dicts (failed rows
    carry an `error`)."""
    ins, do = make_inputs(shape, dtype, device)
    results, ready = [], []
    for row, impl, window in rows:
        result = dict(group=name, impl=row, shape=shape, window=window, baseline=row == baseline)
        fn = attention_fn(impl, window)
        try:
            torch.autograd.grad(fn(*ins), ins, do)  # at the benchmark's shape: Triton autotunes for it here
            result["err"] = check(fn, ins, do, window)
        except Exception as err:  # a backend that refuses this case: printed, not dropped
            result["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:150]}"
        else:
            if result["err"] > CHECK_TOLERANCE[dtype]:
                result["error"] = f"wrong: max relative error {result['err']:.2e} vs float64"
            else:
                result["peak_mib"] = _peak_mib(fn, ins, do, device)
                ready.append((result, fn))
        results.append(result)
    timer = _timer(device)
    times = {id(r): ([], []) for r, _ in ready}
    for _ in range(rounds):
        for result, fn in ready:
            fwd, fb = times[id(result)]
            with torch.no_grad():
                fwd.append(timer(lambda: fn(*ins), inner))
            fb.append(timer(lambda: torch.autograd.grad(fn(*ins), ins, do), inner))
    for result, _ in ready:
        fwd, fb = times[id(result)]
        result.update(fwd_ms=statistics.median(fwd), fb_ms=statistics.median(fb))
    return results


def gpu_table(cases, dtype, device, rounds, inner, unit):
    print_header(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, {dtype}".replace("torch.", ""),
                 unit)
    for name, shape, rows, baseline in cases:
        print_rows(run_case(name, shape, rows, baseline, dtype, device, rounds, inner), unit)


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
    """The float64 check in this process, then memory and timings, each in a fresh subprocess."""
    ins, do = make_inputs(shape, torch.float32, "cpu")
    result = {"err": check(attention_fn(impl.split()[0], window), ins, do, window)}
    if result["err"] > CHECK_TOLERANCE[torch.float32]:
        return {**result, "error": f"wrong: max relative error {result['err']:.2e} vs float64"}
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


def cpu_table(quick, threads):
    lengths, reps = ((256, 512), 3) if quick else ((1024, 2048), 7)
    print_header(f"CPU, {threads} thread(s), float32", "GF")
    for t in lengths:
        shape = (1, 12, t, 64)
        rows = [dict(group=f"T={t} d=64 causal", impl=impl, shape=shape, window=window, baseline=impl == "reference",
                     **cpu_case(impl, shape, window, reps, threads))
                for impl, window in (("reference", None), ("torch", None), ("torch w=256", 256))]
        print_rows(rows, "GF")


# ---------------------------------------------------------------- the table
def print_header(device, unit):
    print(f"attention benchmark on {device}; ratios against the row marked * in each case")
    head = (f"{'case':<24} {'impl':<24} {'fwd ms':>9} {f'fwd {unit}/s':>9} {'f+b ms':>9} {f'f+b {unit}/s':>9} "
            f"{'peak MiB':>9} {'err':>8} {'speed×':>7} {'mem×':>6}")
    print(head)
    print("-" * len(head), flush=True)


def print_rows(rows, unit):
    """One line per row of one case; speed× = baseline time / time (fwd+bwd), mem× = peak / baseline
    peak. unit: "TF" or "GF", the FLOP/s scale. A failed row prints its reason instead of figures."""
    scale = {"TF": 1e9, "GF": 1e6}[unit]  # FLOPs per ms
    base = next((r for r in rows if r["baseline"] and "error" not in r), None)
    for row in rows:
        name = row["impl"] + (" *" if row["baseline"] else "")
        if "error" in row:
            print(f"{row['group']:<24} {name:<24} FAILED {row['error']}")
            continue
        fwd_tf = attention_flops(row["shape"], row["window"], False) / row["fwd_ms"] / scale
        fb_tf = attention_flops(row["shape"], row["window"], True) / row["fb_ms"] / scale
        speed = f"{base['fb_ms'] / row['fb_ms']:>7.2f}" if base else f"{'n/a':>7}"
        mem = f"{row['peak_mib'] / base['peak_mib']:>6.3f}" if base else f"{'n/a':>6}"
        print(f"{row['group']:<24} {name:<24} {row['fwd_ms']:>9.2f} {fwd_tf:>9.2f} {row['fb_ms']:>9.2f} "
              f"{fb_tf:>9.2f} {row['peak_mib']:>9.1f} {row['err']:>8.1e} {speed} {mem}")
    if base is None:
        print(f"{rows[0]['group']:<24} (the baseline failed: no ratios for this case)")
    sys.stdout.flush()


def main():
    # SDPA explains in a UserWarning why each backend it tried declined a case; the row that cannot
    # run is reported as FAILED with the error, so the table is kept free of those explanations.
    warnings.filterwarnings("ignore", category=UserWarning, message=r".*(not used because|runtime disabled|"
                            r"does not support non-null attn_mask|not supported|Aborting).*")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--cpu", action="store_true", help="the CPU benchmark even when CUDA is available")
    parser.add_argument("--smoke", action="store_true", help="the GPU benchmark's code on the CPU, toy sizes")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads per case")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one CPU case, as JSON
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(cpu_worker(json.loads(args.worker))))
    elif args.smoke:
        gpu_table(smoke_cases(), torch.float32, torch.device("cpu"), rounds=2, inner=1, unit="GF")
    elif torch.cuda.is_available() and not args.cpu:
        gpu_table(gpu_cases(args.quick), torch.bfloat16, torch.device("cuda"), rounds=10, inner=3, unit="TF")
    else:
        cpu_table(args.quick, args.threads)


if __name__ == "__main__":
    main()
