"""The step bill (bench/step_bill.py, bench/op_ledger.py): kernels, bytes, FLOPs and device→host reads counted on
fake tensors, against counts written by hand; the bill of a real toy run; a read added to the step caught."""

from __future__ import annotations

from pathlib import Path

import torch
from cli import TINY, write_corpus
from distributed import run_distributed
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.op_ledger import OpLedger

F32 = 4


def test_the_ledger_counts_what_a_hand_count_says():
    """A product, a view, an in-place op, a reduction, a multi-tensor op over 200 tensors, a read of a value
    made here and a read of one made before: each counted as written beside it."""
    with FakeTensorMode(), OpLedger() as ledger, ledger.reading_hooks():
        a, b = torch.randn(64, 32), torch.randn(32, 48)
        params = [torch.randn(1000) for _ in range(200)]
        earlier = torch.zeros(3)  # made before the recording: an earlier step's value
        ledger.recording = True
        y = a @ b  # gemm: 2·64·32·48 FLOPs; reads a and b, writes y
        y = y.t()  # a view: no kernel
        y.relu_()  # 1 kernel: reads and writes y
        total = y.sum()  # 1 kernel: reads y, writes one float
        torch._foreach_add_(params, 1.0)  # 200 tensors, one chunk each, 110 tensors a launch: 2 launches
        float(total)  # a read of a value this step made: waits for everything queued
        earlier.tolist()  # a read of an earlier step's value: one late read, not three
    ops = [op for op in ledger.ops if op.kind != "query"]
    kinds = [(op.kind, op.kernels) for op in ops]
    assert kinds == [("gemm", 1), ("view", 0), ("memory", 1), ("memory", 1), ("multi_tensor", 2), ("read", 0),
                     ("late read", 0)], kinds
    gemm, _, relu, total_sum, foreach, _, _ = ops
    assert gemm.flops == 2 * 64 * 32 * 48 and gemm.gemm == (64, 48, 32)
    assert gemm.bytes == (64 * 32 + 32 * 48 + 64 * 48) * F32
    assert relu.bytes == 2 * 64 * 48 * F32 and total_sum.bytes == (64 * 48 + 1) * F32
    assert foreach.bytes == 2 * 200 * 1000 * F32  # each tensor read and written (the scalar is no tensor)


def test_a_blocks_forward_and_backward_launch_the_kernels_counted_by_hand():
    """One gpt3d Block in bf16 with the Triton attention, as the bill sees it: its forward is 10 kernels (two
    LayerNorms, four products, the attention, GELU, two residual adds); its backward 20 (three a linear: the
    input's and the weight's products and the bias's sum; the attention's 3; GELU's 1; each LayerNorm's 1;
    the two residual gradients' sums)."""
    from model import GPTConfig
    from model.layers import Block

    config = GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=64, attention_impl="triton")
    block = Block(config, 0).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True), OpLedger() as ledger:
        x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
        ledger.recording = True
        out = block(x)
        forward = sum(op.kernels for op in ledger.ops)
        out.backward(torch.ones_like(out))
        backward = sum(op.kernels for op in ledger.ops) - forward - 1  # less ones_like's fill
    assert (forward, backward) == (10, 20)


def bill_worker(corpus: str) -> tuple[dict, dict]:
    """The bill of a tiny run, then of the same run whose step reads its loss back (float), as a careless
    change would."""
    from bench.step_bill import step_bill
    from train.run import step

    overrides = [o for o in TINY if not o.startswith(("model.n_layer", "train.global", "train.micro"))]
    overrides += ["model.n_layer=1", "train.global_batch_size=2", "train.micro_batch_size=2", "data.streams=1",
                  f"data.paths=[{corpus}/*.txt]"]
    clean = step_bill(overrides)
    original = step.TrainStep._step

    def careless(self, windows):
        result = original(self, windows)
        float(result.loss)  # a device→host read every step
        return result

    step.TrainStep._step = careless
    try:
        return clean, step_bill(overrides)
    finally:
        step.TrainStep._step = original


def test_the_bill_of_a_toy_run_reads_nothing_and_a_read_added_to_the_step_is_caught(tmp_path):
    corpus = write_corpus(tmp_path)
    clean, careless = run_distributed(bill_worker, 1, str(corpus), timeout=600)[0]
    assert clean["reads"] == [] and len(clean["late_reads"]) == 1  # the step before, settled one step late
    import train.run.step

    source = Path(train.run.step.__file__).read_text().splitlines()
    caller = next(i for i, text in enumerate(source, 1) if "return self._step(windows)" in text)
    assert careless["reads"] == [f"train/run/step.py:{caller}"]  # the careless step's caller, named
    for bill in (clean, careless):
        assert bill["precision"] == "bf16" and bill["micro_batches"] == 1
        assert bill["kernels"] == sum(row["kernels"] for row in bill["by_kind"].values())
        assert bill["kernels"] == sum(row["kernels"] for row in bill["by_line"])
        assert bill["by_kind"]["attention"]["kernels"] == 4  # the one block's forward 1 and backward 3
        for predicted in bill["predicted"].values():
            assert predicted["step_ms"] >= predicted["device_busy_ms"] > 0
    # the same work; the read stalls the host behind the device, so the step cannot be faster
    assert careless["kernels"] == clean["kernels"]
    assert careless["predicted"]["h200"]["step_ms"] >= clean["predicted"]["h200"]["step_ms"]
