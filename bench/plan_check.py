"""The planner's predictions against measured training steps on this machine's GPU.

  python -m bench.plan_check            # GPT-3 350M … 2.7B shapes at T = 2048 (about 5 minutes on an H100)
  python -m bench.plan_check --quick    # two small cases

Each case runs what a one-GPU gpt3d run does per optimizer step (fp32 parameters, bf16 autocast,
the fused attention, m micro batches of gradient accumulation, AdamW; optionally activation
checkpointing) and measures the step time (median of 5 steps after 2 warm-up steps, CUDA
synchronised) and the peak memory (torch.cuda.max_memory_allocated over one step). The planner
predicts both for the same layout from the hardware preset named by --hardware (default: the
preset matching this GPU) and the table prints measured / predicted. The first rows measure the
device's GEMM rate and copy bandwidth, and the fused attention's forward+backward rate, against
the preset's figures (the step-time model's inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import GPT, GPTConfig
from model.modes import LayerModes

SHAPES = {  # name: (n_layer, n_head, d_model)
    "gpt3-350m": (24, 16, 1024),
    "gpt3-760m": (24, 16, 1536),
    "gpt3-1.3b": (24, 16, 2048),
    "gpt3-2.7b": (32, 32, 2560),
}
CASES = [  # (shape, micro batch, micro batches, checkpoint every k blocks)
    ("gpt3-350m", 8, 2, 0),
    ("gpt3-760m", 4, 2, 0),
    ("gpt3-760m", 4, 2, 1),
    ("gpt3-1.3b", 4, 2, 0),
    ("gpt3-1.3b", 8, 2, 1),
    ("gpt3-2.7b", 4, 2, 1),
]
QUICK = [("gpt3-350m", 2, 2, 0), ("gpt3-350m", 2, 2, 1)]


def _timed(fn, repeat: int) -> float:
    """Median seconds of fn() after synchronising, over `repeat` calls."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings() -> dict:
    """Measured GEMM FLOP/s (8192³ bf16), copy bytes/s (read + write) and attention FLOP/s."""
    from model.attention import attention

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    gemm = 2 * 8192**3 / _timed(lambda: a @ b, 20)
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), 20)
    shape = (8, 16, 2048, 128)  # (B, H, T, D)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        attention(q, k, v, causal=True).backward(grad)

    for _ in range(3):
        fwd_bwd()
    pairs = 2048 * 2049 / 2
    attn = 3.5 * 4 * 8 * 16 * 128 * pairs / _timed(fwd_bwd, 10)
    return {"gemm_flops": gemm, "copy_bytes": copy, "attention_flops": attn}


def measure(cfg: GPTConfig, micro_batch: int, micro_batches: int, checkpoint_every: int) -> tuple[float, float]:
    """(median step seconds, peak bytes) of one-GPU training steps."""
    with torch.device("meta"):
        model = GPT(cfg, modes=LayerModes(activation_checkpointing=checkpoint_every))
    model.materialize("cuda", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batches, micro_batch, cfg.seq_len + 1), device="cuda")

    def step():
        for window in tokens:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(window[:, :-1], window[:, 1:]) / micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated()
    seconds = _timed(step, 5)
    del model, optimizer
    torch.cuda.empty_cache()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small cases")
    parser.add_argument("--hardware", help="planner preset (default: the one matching this GPU)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.plan_check measures training steps on a GPU; no CUDA device is visible")
    from train.planner.estimate import Layout, build_plan, for_precision
    from train.planner.hardware import for_cuda_device, preset

    hardware = preset(args.hardware) if args.hardware else for_cuda_device()
    measured = ceilings()
    print(f"planner check on {torch.cuda.get_device_name()} against preset {hardware.name}")
    print(f"{'ceiling':<34} {'measured':>12} {'preset':>12} {'ratio':>6}")
    for label, got, assumed in [
        ("GEMM TFLOP/s (8192³ bf16)", measured["gemm_flops"] / 1e12, hardware.flops / 1e12),
        ("copy TB/s (read + write)", measured["copy_bytes"] / 1e12, hardware.memory_bandwidth / 1e12),
        ("attention fwd+bwd TFLOP/s", measured["attention_flops"] / 1e12, hardware.peak_tflops * 0.5),
    ]:
        print(f"{label:<34} {got:>12.1f} {assumed:>12.1f} {got / assumed:>6.2f}")
    print(f"\n{'case':<36} {'step s':>8} {'pred s':>8} {'ratio':>6} {'peak GiB':>9} {'pred GiB':>9} {'ratio':>6}")
    for name, micro_batch, micro_batches, ckpt in QUICK if args.quick else CASES:
        n_layer, n_head, d_model = SHAPES[name]
        cfg = GPTConfig(name=name, n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=2048)
        layout = Layout(1, 1, 1, micro_batch * micro_batches, micro_batch, checkpoint_every=ckpt)
        # what measure() runs: fp32 weights under bf16 autocast, the plain loss of a bare GPT, one GPU
        plan = build_plan(cfg, layout, hardware, implementation=for_precision("autocast", fused_loss=False))
        seconds, peak = measure(cfg, micro_batch, micro_batches, ckpt)
        label = f"{name} micro={micro_batch}×{micro_batches} ckpt={ckpt}"
        pred_gib, peak_gib = plan.peak_memory_gib, peak / 2**30
        print(f"{label:<36} {seconds:>8.3f} {plan.step_time_s:>8.3f} {seconds / plan.step_time_s:>6.2f} "
              f"{peak_gib:>9.2f} {pred_gib:>9.2f} {peak_gib / pred_gib:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
