"""Attention benchmark: one table per run, every ratio against a baseline measured in the same run.

  python -m bench.attention           # CUDA when available, else CPU
  python -m bench.attention --quick   # small sizes: a smoke run (under a minute on CPU)
  python -m bench.attention --cpu     # the CPU benchmark on a machine with a GPU
  python -m bench.attention --smoke   # the GPU benchmark's code on the CPU at toy sizes, float32
  python -m bench.attention --banded  # the banded cases alone, against FlexAttention (GPU)
  python -m bench.attention --json results.json   # also every row as JSON (any of the modes above)

GPU, bf16, B=8, H=16, T=2048, head dims 64, 80, 96, 128, and B=2, H=16, T=8192 at head dims 64 and
128 (the same tokens per batch; --quick: B=2, T=512, d 64 and 128 only):
  causal        impl="triton", the same kernel with deterministic=True (triton-det), flash-attn's
                flash_attn_func and its deterministic backward (flash-attn, flash-attn-det: rows
                only when `import flash_attn` works), and torch's scaled_dot_product_attention under
                each backend, forced one at a time with sdpa_kernel: sdpa-flash (the baseline),
                sdpa-cudnn, sdpa-efficient;
  window 256    impl="triton" banded (and deterministic), the same kernel dense causal, flash-attn
                with window_size=(255, 0), and each SDPA backend with the band as a boolean mask (which
                computes the whole square; sdpa-efficient, the one that takes any mask, is the
                baseline). With --banded these cases alone, with FlexAttention as their baseline
                (torch.nn.attention.flex_attention, compiled, with a sliding-window block mask: it
                skips the blocks outside the band, as the kernel does), the competitor GPT-3's banded
                layers are measured against; its compile takes most of a minute per case.
Before timing, each row's forward and gradients are checked against a float64 reference on the
first (batch, 2 heads) slice of its inputs (column `err`: max relative error; above 2e-2 the row
is reported as failed and not timed). A row whose backend refuses the case is printed with the
reason, never dropped. The rows of a case are timed alternately, round by round (forward under
no_grad, then forward+backward through torch.autograd.grad), so drifting clocks or a busy machine
affect them alike; times are medians over the rounds.
CPU, float32, B=1, H=12, T=1024 and 2048 (--quick: T=512 only), d=64: impl="torch" (and its banded form)
against impl="reference"; each case's peak
resident memory and its timings are measured in fresh subprocesses (see bench/README.md), times
are the minimum over repetitions (the least disturbed by other load on the machine).

FLOPs count the visible (query, key) pairs exactly, in-band only: forward 4·B·H·D·pairs (two
matmuls), backward 2.5× that (five matmuls); causal pairs = T(T+1)/2 ≈ T²/2, banded ≈ T·w, whatever
a row computes outside the band (SDPA's masked square, FlexAttention's partial edge blocks). speed× = the baseline's
forward+backward time / this row's (above 1: faster); mem× = this row's peak / the baseline's.
The deterministic backward does seven matmuls' work, but its FLOP/s are counted with the same five,
so its rows compare the time to the same result.

--json PATH writes a JSON list with one object per row (failed rows included, with their `error`):
case, implementation, batch, heads, head_dim, T, causal, window, dtype, fwd_ms, fwd_tflops,
fwd_bwd_ms, fwd_bwd_tflops, speed_vs_baseline, baseline (the case's baseline row), is_baseline, err,
peak_mib, mem_vs_baseline, error, device (the GPU's name, or "CPU"), commit (`git rev-parse HEAD`
of this checkout, null outside git), date (UTC) and command. Figures that do not apply are null.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
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
FLASH_ATTN = ("flash-attn", "flash-attn-det")  # flash_attn_func, with deterministic=False / True
FLEX = "flex"  # torch.nn.attention.flex_attention with a causal (sliding-window) block mask
REPO = Path(__file__).resolve().parents[1]
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


def flash_attn_available() -> bool:
    """Whether the flash-attn package imports here (its rows are left out when it does not)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:  # not installed, or built for another torch / CUDA: either way no rows
        return False
    return True


def attention_fn(impl, window):
    """fn(q, k, v), causal, for "triton", "triton-det" (deterministic=True), "torch", "reference", an
    SDPA backend ("sdpa-flash", ...), FlexAttention ("flex", `flex_fn`) or flash-attn ("flash-attn",
    "flash-attn-det"). SDPA gets
    is_causal without a window and the band as a boolean mask with one; flash-attn takes (B, T, H, D)
    and the band as window_size=(w − 1, 0)."""
    if impl in FLASH_ATTN:
        from flash_attn import flash_attn_func

        window_size = (-1, -1) if window is None else (window - 1, 0)
        deterministic = impl == "flash-attn-det"
        return lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=window_size,
            deterministic=deterministic).transpose(1, 2)  # (B, H, T, D) from (B, T, H, D)
    if impl == FLEX:
        return flex_fn(window)
    if impl not in SDPA_BACKENDS:
        deterministic = impl == "triton-det"
        impl = "triton" if deterministic else impl
        return lambda q, k, v: attention(q, k, v, causal=True, window=window, impl=impl, deterministic=deterministic)
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


def flex_fn(window):
    """fn(q, k, v), causal, through FlexAttention: its block mask (query i sees key j iff j ≤ i, and
    i − j < window with one) built once per length and device outside the timed calls; compiled on a
    GPU (eager FlexAttention is an unfused reference), eager on the CPU (the smoke run)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep if window is None else keep & (q_idx - kv_idx < window)

    masks, compiled = {}, {}

    def run(q, k, v):
        t = q.shape[-2]
        if (t, q.device) not in masks:
            masks[t, q.device] = create_block_mask(visible, None, None, t, t, device=q.device)
        if q.device not in compiled:
            compiled[q.device] = torch.compile(flex_attention) if q.is_cuda else flex_attention
        return compiled[q.device](q, k, v, block_mask=masks[t, q.device])  # (B, H, T, D)

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
def gpu_cases(quick, flash_attn, banded=False):
    """(case name, shape, [(row name, impl, window)], baseline row) for the GPU table; flash_attn:
    whether to add the flash-attn rows; banded: the window cases alone, with FlexAttention's rows
    (its baseline), whose compile takes most of a minute per head dim and length."""
    sizes = [(2, 512, (64, 128))] if quick else [(8, 2048, (64, 80, 96, 128)), (2, 8192, (64, 128))]
    flash = FLASH_ATTN if flash_attn else ()
    cases = []
    for b, t, dims in sizes:
        for d in dims:
            shape = (b, 16, t, d)
            if not banded:
                cases.append((f"T={t} d={d} causal", shape,
                              [("triton", "triton", None), ("triton-det", "triton-det", None),
                               *((name, name, None) for name in (*flash, *SDPA_BACKENDS))], "sdpa-flash"))
            others = (FLEX, *flash, *SDPA_BACKENDS) if banded else (*flash, *SDPA_BACKENDS)
            cases.append((f"T={t} d={d} window 256", shape,
                          [("triton w=256", "triton", 256), ("triton-det w=256", "triton-det", 256),
                           ("triton dense", "triton", None), *((f"{name} w=256", name, 256) for name in others)],
                          "flex w=256" if banded else "sdpa-efficient w=256"))
    return cases


def smoke_cases(flash_attn):
    """The GPU table's rows at toy sizes, against impl="torch"; flash_attn: add the flash-attn rows."""
    shape = (1, 2, 128, 64)
    flash = FLASH_ATTN if flash_attn else ()
    return [("T=128 d=64 causal", shape, [("triton", "triton", None), ("triton-det", "triton-det", None),
                                          ("torch", "torch", None),
                                          *((name, name, None) for name in (*flash, *SDPA_BACKENDS))], "torch"),
            ("T=128 d=64 window 32", shape,
             [("torch w=32", "torch", 32), *((f"{name} w=32", name, 32) for name in (FLEX, *flash)),
              ("sdpa-efficient w=32", "sdpa-efficient", 32)], "torch w=32")]


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
    """Runs and prints every case; returns all rows, each with its dtype."""
    print_header(f"{device_name(device)}, {dtype}".replace("torch.", ""), unit)
    every_row = []
    for name, shape, rows, baseline in cases:
        results = run_case(name, shape, rows, baseline, dtype, device, rounds, inner)
        print_rows(results, unit)
        every_row += [{**r, "dtype": str(dtype).replace("torch.", "")} for r in results]
    return every_row


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


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
    lengths, reps = ((512,), 3) if quick else ((1024, 2048), 7)
    print_header(f"CPU, {threads} thread(s), float32", "GF")
    every_row = []
    for t in lengths:
        shape = (1, 12, t, 64)
        rows = [dict(group=f"T={t} d=64 causal", impl=impl, shape=shape, window=window, baseline=impl == "reference",
                     **cpu_case(impl, shape, window, reps, threads))
                for impl, window in (("reference", None), ("torch", None), ("torch w=256", 256))]
        print_rows(rows, "GF")
        every_row += [{**r, "dtype": "float32"} for r in rows]
    return every_row


# ---------------------------------------------------------------- the table
def print_header(device, unit):
    print(f"attention benchmark on {device}; ratios against the row marked * in each case")
    head = (f"{'case':<24} {'impl':<24} {'fwd ms':>9} {f'fwd {unit}/s':>9} {'f+b ms':>9} {f'f+b {unit}/s':>9} "
            f"{'peak MiB':>9} {'err':>8} {'speed×':>7} {'mem×':>6}")
    print(head)
    print("-" * len(head), flush=True)


def case_baseline(rows):
    """The case's baseline row, or None when it failed (then no row has ratios)."""
    return next((r for r in rows if r["baseline"] and "error" not in r), None)


def print_rows(rows, unit):
    """One line per row of one case; speed× = baseline time / time (fwd+bwd), mem× = peak / baseline
    peak. unit: "TF" or "GF", the FLOP/s scale. A failed row prints its reason instead of figures."""
    scale = {"TF": 1e9, "GF": 1e6}[unit]  # FLOPs per ms
    base = case_baseline(rows)
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


def json_records(rows, device: str, command: str) -> list[dict]:
    """One JSON-ready dict per row (see the module docstring for the fields); rows of one case are
    consecutive and share their `group`."""
    commit = git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cases = {}
    for row in rows:
        cases.setdefault(row["group"], []).append(row)
    records = []
    for case_rows in cases.values():
        base = case_baseline(case_rows)
        baseline_name = next(r["impl"] for r in case_rows if r["baseline"])
        for row in case_rows:
            b, h, t, d = row["shape"]
            ok = "error" not in row
            tflops = {key: attention_flops(row["shape"], row["window"], backward) / row[ms] / 1e9 if ok else None
                      for key, ms, backward in (("fwd", "fwd_ms", False), ("fwd_bwd", "fb_ms", True))}
            records.append({
                "case": row["group"], "implementation": row["impl"], "batch": b, "heads": h, "head_dim": d, "T": t,
                "causal": True, "window": row["window"], "dtype": row["dtype"],
                "fwd_ms": row.get("fwd_ms"), "fwd_tflops": tflops["fwd"],
                "fwd_bwd_ms": row.get("fb_ms"), "fwd_bwd_tflops": tflops["fwd_bwd"],
                "speed_vs_baseline": base["fb_ms"] / row["fb_ms"] if ok and base else None,
                "baseline": baseline_name, "is_baseline": row["baseline"], "err": row.get("err"),
                "peak_mib": _finite(row.get("peak_mib")),
                "mem_vs_baseline": _finite(row["peak_mib"] / base["peak_mib"]) if ok and base else None,
                "error": row.get("error"), "device": device, "commit": commit, "date": date, "command": command})
    return records


def _finite(x):
    """x, or None for NaN (no measurement, e.g. CUDA memory on a CPU), which JSON cannot hold."""
    return None if x is None or math.isnan(x) else x


def git_commit() -> str | None:
    """HEAD of the checkout this file is in, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main():
    # SDPA explains in a UserWarning why each backend it tried declined a case; the row that cannot
    # run is reported as FAILED with the error, so the table is kept free of those explanations.
    warnings.filterwarnings("ignore", category=UserWarning, message=r".*(not used because|runtime disabled|"
                            r"does not support non-null attn_mask|not supported|Aborting).*")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--cpu", action="store_true", help="the CPU benchmark even when CUDA is available")
    parser.add_argument("--smoke", action="store_true", help="the GPU benchmark's code on the CPU, toy sizes")
    parser.add_argument("--banded", action="store_true",
                        help="on a GPU: the 256-token window cases alone, against FlexAttention (compiled)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads per case")
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write every row to PATH as a JSON list")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one CPU case, as JSON
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(cpu_worker(json.loads(args.worker))))
        return
    if args.smoke:
        device = torch.device("cpu")
        rows = gpu_table(smoke_cases(flash_attn_available()), torch.float32, device, rounds=2, inner=1, unit="GF")
    elif torch.cuda.is_available() and not args.cpu:
        device = torch.device("cuda")
        cases = gpu_cases(args.quick, flash_attn_available(), args.banded)
        rows = gpu_table(cases, torch.bfloat16, device, rounds=10, inner=3, unit="TF")
    else:
        device = torch.device("cpu")
        rows = cpu_table(args.quick, args.threads)
    if args.json:
        command = " ".join(["python -m bench.attention", *sys.argv[1:]])
        args.json.write_text(json.dumps(json_records(rows, device_name(device), command), indent=1) + "\n")


if __name__ == "__main__":
    main()
