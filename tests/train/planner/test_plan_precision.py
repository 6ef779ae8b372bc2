"""train.precision and selective recomputation in the planner, against hand-computed bytes.

State bytes follow DeepSpeed 0.19 under train.precision=bf16's settings (train/planner/counts.py docstring);
the numbers below are worked out by hand for a rank holding one 8×4 matrix and one 4-vector over
dp = 2 (each group flattened and padded to a multiple of 2·dp = 4 elements: 32 and 4, partitions of
16 and 2 elements). Activations: the per-token terms of train/planner/activations.py's docstring.
"""

from __future__ import annotations

import pytest

from model import GPTConfig
from train.planner.activations import micro_batch_activations
from train.planner.counts import ParamShape, state_bytes
from train.planner.estimate import Implementation, Layout, build_plan, for_precision
from train.planner.hardware import preset

PARAMS = [ParamShape("w", (8, 4), 32), ParamShape("b", (4,), 4)]
TOY = GPTConfig(name="toy", n_layer=2, n_head=4, d_model=128, seq_len=64)


@pytest.mark.parametrize("zero, expected", [
    # weights, gradients, master, moments (bytes)
    (0, (2 * 36, 4 * 36, 4 * 18, 8 * 18)),  # BF16_Optimizer: its fp32 accumulation buffer (bf16 grads: the engine's)
    (1, (2 * 36, 4 * 36, 4 * 18, 8 * 18)),  # the same optimizer (DeepSpeed runs both at stage 1)
    (2, (2 * 36, 2 * 36, 4 * 18, 8 * 18)),  # ZeRO optimizer: rank 0's partitions overlap both parameters
    (3, (2 * (18 + 36), 2 * 18, 4 * 18, 8 * 18)),  # pieces + both persistent (≤ 1e5) in full
])
def test_bf16_state_bytes_per_zero_stage(zero, expected):
    state = state_bytes(PARAMS, zero, 2, 0, bf16_weights=True, reduce_bucket_size=1000)
    assert (state.weights, state.gradients, state.master, state.moments) == expected
    assert state.buffers == (2 * 1000 if zero == 3 else 0)  # one bf16 reduce bucket


def test_bf16_keeps_no_weight_casts_and_a_bf16_residual_stream():
    n, d = 2 * TOY.seq_len, TOY.d_model
    autocast = micro_batch_activations(TOY, 1, 1, 0, 2, autocast=True)
    bf16 = micro_batch_activations(TOY, 1, 1, 0, 2, autocast=True, bf16_weights=True)
    assert autocast.weight_copies > 0 and bf16.weight_copies == 0
    # each block's two LayerNorm inputs and the head's final-norm input: 4 → 2 bytes an element
    assert autocast.activations - bf16.activations == (2 * TOY.n_layer + 1) * 2 * n * d


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, False), (2, True)])
def test_selective_recomputation_drops_layernorm_and_gelu_outputs(tp, sequence_parallel):
    n, d, f, a = 2 * TOY.seq_len, TOY.d_model, TOY.d_ff, 2
    kwargs = dict(sequence_parallel=sequence_parallel, autocast=True, bf16_weights=True)
    full = micro_batch_activations(TOY, tp, 1, 0, 2, **kwargs)
    selective = micro_batch_activations(TOY, tp, 1, 0, 2, selective=True, **kwargs)
    per_block = a * f // tp * n + (0 if sequence_parallel else 2 * a * d * n)  # GELU out; ln_1, ln_2 out
    assert full.saved - selective.saved == TOY.n_layer * per_block


@pytest.mark.parametrize("gpus", [2, 1], ids=["by-flops-and-bytes", "launch-by-launch"])
def test_selective_recomputation_costs_its_memory_bound_recompute(gpus):
    """Selective adds, per block and micro batch, LayerNorm and GELU forwards at HBM bandwidth and nothing else:
    with data parallelism in the FLOP-and-bytes model (three kernel launches, below the device time here); on
    one GPU, priced launch by launch (train/planner/one_gpu.py), also those three kernels' shortest times."""
    from train.planner.kernel_costs import KERNEL_FLOOR_S

    cfg = GPTConfig(name="1.3b", n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    hw, impl = preset("h100-80g"), for_precision("bf16")
    plain = build_plan(cfg, Layout(1, 1, gpus, 4 * gpus, 4), hw, implementation=impl)
    selective = build_plan(cfg, Layout(1, 1, gpus, 4 * gpus, 4, selective_recompute=True), hw, implementation=impl)
    n, d, f = 4 * 2048, 2048, 8192
    extra = 24 * n * (2 * (2 + 2) * d + 2 * 2 * f) / hw.memory_bandwidth  # LayerNorm r·d in, a·d out, twice; GELU
    extra += 24 * 3 * KERNEL_FLOOR_S if gpus == 1 else 0
    assert selective.ranks[0].time["compute_s"] - plain.ranks[0].time["compute_s"] == pytest.approx(extra, rel=1e-9)


def test_precision_from_the_config():
    from train.plan import load
    from train.planner.from_config import implementation_from_config, plan_from_config

    base = ["model=gpt3-1.3b", "plan.gpus=8", "train.global_batch_size=64", "train.micro_batch_size=4"]
    sections, _, model_cfg = load(base)
    assert implementation_from_config(sections.train, sections.parallel, model_cfg.compile).precision == "bf16"  # auto: as on a GPU
    for precision in ("fp32", "autocast", "bf16", "fp8"):
        assert plan_from_config(*load([*base, f"++train.precision={precision}"])).implementation.precision == precision
    sections, _, model_cfg = load([*base, "train.precision=fp8", "train.fp8_recipe=rowwise", "model.compile=true"])
    fp8 = implementation_from_config(sections.train, sections.parallel, model_cfg.compile)
    assert (fp8.fp8, fp8.compiled, fp8.bf16_weights) == ("rowwise", True, True)
    assert for_precision("autocast", overlap_communication=False) == Implementation()  # today's model
    with pytest.raises(ValueError, match="train.precision='fp16'.*auto"):
        load([*base, "++train.precision=fp16"])


@pytest.mark.parametrize("recipe, cast_bytes", [("tensorwise", 8), ("rowwise", 10)])
def test_fp8_runs_the_block_gemms_at_twice_the_rate_and_adds_the_casts_traffic(recipe, cast_bytes):
    """Compiled (no launch bound): per block and micro batch, the four linears' three products each take
    half their bf16 time (compute-bound at these shapes), and their casts move cast_bytes per element of
    x, W and g at HBM bandwidth; nothing else changes. Eager, the casts' kernels bound the micro batch:
    30 µs of host time for each of the block's 100 kernels and 4 × 46 (tensorwise) more, and for the
    one kernel a parameter tensor of BF16_Optimizer's per-micro-batch update (fp8 keeps bf16's weights;
    ZeRO 0: 292 tensors, 24 blocks of 12, the two embeddings and the final LayerNorm's two)."""
    cfg = GPTConfig(name="1.3b", n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    hw, layout = preset("h100-80g"), Layout(1, 1, 2, 8, 4)  # two GPUs: bf16 by the same FLOP-and-bytes model as fp8
    bf16 = build_plan(cfg, layout, hw, implementation=for_precision("bf16"))
    fp8 = build_plan(cfg, layout, hw, implementation=for_precision("fp8", fp8_recipe=recipe, compiled=True))
    n, d, f = 4 * 2048, 2048, 8192
    linears = [(n, d, 3 * d), (n, d, d), (n, d, f), (n, f, d)]
    gemms = sum(3 * n * k * m / hw.flops for n, k, m in linears)  # bf16: 3 products of 2nkm FLOPs; fp8: half
    casts = sum(cast_bytes * (n * k + k * m + n * m) for n, k, m in linears) / hw.memory_bandwidth
    difference = fp8.ranks[0].time["compute_s"] - bf16.ranks[0].time["compute_s"]
    assert difference == pytest.approx(24 * (casts - gemms), rel=1e-9)
    if recipe == "tensorwise":
        eager = build_plan(cfg, layout, hw, implementation=for_precision("fp8"))
        tensors = 24 * 12 + 2 + 2
        assert eager.ranks[0].time["compute_s"] == pytest.approx((24 * (100 + 4 * 46) + tensors) * 30e-6, rel=1e-9)


def test_fused_loss_from_the_config():
    """train.fused_loss (default true) picks the loss the head's memory is counted for: by hand, at
    tp = 1 in bf16 the plain loss keeps the unembedding's input (2·d), the log-softmax (4·V) and the
    targets (8) a token, the fused one ∂L/∂h (2·d a token, in the matmul dtype) and ∂L/∂W (4·Vp·d)."""
    from train.plan import load
    from train.planner.from_config import plan_from_config

    base = ["model=gpt3-1.3b", "plan.gpus=8", "train.global_batch_size=64", "train.micro_batch_size=4"]
    fused, plain = plan_from_config(*load(base)), plan_from_config(*load([*base, "train.fused_loss=false"]))
    assert fused.implementation.fused_loss and not plain.implementation.fused_loss
    n, d, v, vp = 4 * 2048, 2048, 50257, 50304
    difference = n * (2 * d + 4 * v + 8) - (2 * n * d + 4 * vp * d)
    assert plain.ranks[-1].activations.saved - fused.ranks[-1].activations.saved == difference
    with pytest.raises(ValueError, match="train.fused_loss='perhaps': must be true or false"):
        load([*base, "train.fused_loss=perhaps"])


def test_the_unembedding_gemms_run_over_the_padded_vocabulary_at_tp1():
    """Vocabularies 50257 and 50304 pad to the same 50304 rows: the same hardware FLOPs and step
    time; the model FLOPs (MFU's) still count the real vocabulary."""
    hw, layout = preset("h100-80g"), Layout(1, 1, 1, 4, 4)
    shape = dict(name="1.3b", n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    odd, padded = (build_plan(GPTConfig(**shape, vocab_size=v), layout, hw) for v in (50257, 50304))
    assert odd.hardware_flops_per_step == padded.hardware_flops_per_step
    assert odd.step_time_s == padded.step_time_s
    assert padded.model_flops_per_step - odd.model_flops_per_step == pytest.approx(6 * 47 * 2048 * 4 * 2048)


def test_the_one_gpu_launch_list_counts_a_block_as_the_bill_does():
    """The planner's list of a block's launches (train/planner/one_gpu.py) holds the kernels counted by hand on the
    real block in tests/bench/test_step_bill.py: 10 forward, 20 backward (the attention's backward 3 of them)."""
    from train.planner.one_gpu import block_launches

    cfg = GPTConfig(name="125m", n_layer=12, n_head=12, d_model=768, seq_len=2048)
    launches = block_launches(cfg, 0, 8, 2, 2, autocast=False)
    assert sum(launch.kernels for launch in launches[:10]) == 10
    assert sum(launch.kernels for launch in launches[10:]) == 20
    assert [launch.kernels for launch in launches if launch.kind == "attention"] == [1, 3]
    assert sum(launch.flops for launch in launches if launch.kind == "gemm") == 3 * 2 * 8 * 2048 * 12 * 768 * 768


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_kernels_an_fp8_linear_adds_are_the_ones_its_code_launches(recipe):
    """bench/op_ledger.py counts the kernels one bf16 linear of 256 → 512 launches on CUDA (fake tensors), forward
    and backward, with its products in float8 (the fused casts, model/float8.py) and without: the planner's
    FP8_KERNELS_PER_LINEAR is the difference."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.op_ledger import OpLedger
    from model.modes import Float8
    from model.recompute import Linear
    from train.planner.estimate import FP8_KERNELS_PER_LINEAR

    def kernels(fp8) -> int:
        linear, ledger = Linear(256, 512, fp8=fp8).to(torch.bfloat16), OpLedger()
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            x = fake.from_tensor(torch.randn(2, 64, 256, dtype=torch.bfloat16)).requires_grad_()
            with ledger:
                ledger.recording = True
                linear(x).sum().backward()
        return sum(op.kernels for op in ledger.ops)

    assert kernels(Float8(recipe=recipe)) - kernels(None) == FP8_KERNELS_PER_LINEAR[recipe]


def test_bf16_gradients_live_as_long_as_the_engine_keeps_them():
    """BF16_Optimizer's bf16 gradients beside its fp32 buffer (estimate.bf16_gradient_bytes), by hand for the toy
    model: one pipeline stage drops each as it is added (the largest parameter's at once: the tied embedding,
    50304 × 128, bf16); gpt3d's own schedules after each pass (one chunk's: a rank's stage of one block and the
    head's LayerNorm); DeepSpeed's 1F1B keeps them all to the step. Under autocast there are none."""
    from train.planner.counts import rank_parameters
    from train.planner.estimate import bf16_gradient_bytes

    bf16 = for_precision("bf16")
    one = Layout(1, 1, 1, 8, 2)
    assert bf16_gradient_bytes(one, bf16, rank_parameters(TOY, 1, 1, 0), []) == (2 * 50304 * 128, 0)
    params = rank_parameters(TOY, 1, 2, 1)  # the last stage: a block, ln_f, the head (tied)
    everything = 2 * sum(p.numel for p in params)
    pipelined = Layout(1, 2, 1, 8, 2)
    assert bf16_gradient_bytes(pipelined, bf16, params, [params]) == (everything, everything)
    own = Layout(1, 2, 1, 8, 2, schedule="zb-h1")
    assert bf16_gradient_bytes(own, bf16, params, [params[:3], params[3:]]) == (
        2 * max(sum(p.numel for p in params[:3]), sum(p.numel for p in params[3:])), 0)
    assert bf16_gradient_bytes(pipelined, for_precision("autocast"), params, [params]) == (0, 0)


def test_deepspeeds_communication_dtype_sets_the_gradient_reduction_bytes():
    """deepspeed.communication_data_type (the deepspeed group) is the dtype DeepSpeed reduces gradients in: under
    bf16 its default is bf16 (2 bytes), fp32 doubles the data-parallel all-reduce's bytes; a value DeepSpeed does not
    take fails, naming those it does."""
    from train.plan import load
    from train.planner.from_config import plan_from_config

    base = ["model=gpt3-1.3b", "plan.gpus=8", "train.global_batch_size=64", "train.micro_batch_size=4",
            "train.precision=bf16", "parallel.zero_stage=1"]

    def reduced(*overrides) -> int:
        plan = plan_from_config(*load([*base, *overrides]))
        return sum(t.total for t in plan.ranks[0].transfers if t.group == "dp" and t.op == "all_reduce")

    assert reduced("+deepspeed.communication_data_type=fp32") == 2 * reduced() == 2 * reduced(
        "+deepspeed.communication_data_type=bf16")
    with pytest.raises(ValueError, match=r"communication_data_type='fp64': must be one of \['fp32', 'fp16', 'bf16'\]"):
        plan_from_config(*load([*base, "+deepspeed.communication_data_type=fp64"]))
