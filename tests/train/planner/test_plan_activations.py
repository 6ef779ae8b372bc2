"""Activation memory per micro batch: the planner against the bytes autograd saves for backward.

The measurement: torch.autograd.graph.saved_tensors_hooks sees every tensor an operation keeps for
its backward (activation checkpointing's segment inputs included); the distinct storages behind
them, parameters left out, are what one micro batch holds until its backward. The planner's count
(train/planner/activations.py) must be within 10% of it: for the toy model and a GPT-3 shape
(125M: 12 layers, d_model 768) at a short sequence, with and without activation checkpointing, in
fp32 and under bf16 autocast (whose saved weight casts the planner counts as weight copies), and
tensor-parallel over 2 processes with and without sequence parallelism. Selective recomputation
(LayerNorm and GELU outputs recomputed in backward) must match within a few bytes, on one process
and at tp = 2 with and without sequence parallelism.

The head is built as parallel.build does for train.fused_loss: the plain loss (logits, then
cross-entropy: the log-softmax kept) or the fused one (the unembedding's loss keeps ∂L/∂h and
∂L/∂W); both are measured, and the head's bytes must match within a few bytes in either.
"""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import run_distributed
from saved_bytes import saved_bytes as count_saved_bytes

from model import GPT, GPTConfig
from model.modes import LayerModes
from train.planner.activations import micro_batch_activations

TOY = GPTConfig(name="toy", n_layer=4, n_head=4, d_model=128, seq_len=128)
GPT3_125M_SHORT = GPTConfig(name="gpt3-125m", n_layer=12, n_head=12, d_model=768, seq_len=64)
MICRO_BATCH = 2
SELECTIVE_SLACK_BYTES = 64  # "within a few bytes": the planner counts what autograd keeps, to the tensor


def saved_bytes(model, cfg: GPTConfig, micro_batch: int, autocast: bool, seed: int = 0) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for one micro batch's backward."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=generator)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return count_saved_bytes(model, tokens[:, :-1], tokens[:, 1:])


@functools.cache
def _build(cfg: GPTConfig, checkpoint_every: int | str, fused_loss: bool = False) -> GPT:
    """The model in these modes, built once per shape and modes (the weights do not matter here)."""
    with torch.device("meta"):
        model = GPT(cfg, modes=LayerModes(fused_loss=fused_loss, activation_checkpointing=checkpoint_every))
    return model.materialize("cpu", seed=0)


@pytest.mark.parametrize("cfg", [TOY, GPT3_125M_SHORT], ids=["toy", "gpt3-125m-T64"])
@pytest.mark.parametrize("checkpoint_every", [0, 1, 3])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_saved_activations_match_the_planner(cfg, checkpoint_every, autocast):
    measured = saved_bytes(_build(cfg, checkpoint_every), cfg, MICRO_BATCH, autocast)
    predicted = micro_batch_activations(cfg, 1, 1, 0, MICRO_BATCH, checkpoint_every=checkpoint_every, autocast=autocast,
                                        fused_loss=False)
    assert predicted.saved == pytest.approx(measured, rel=0.10), (predicted, measured)


@pytest.mark.parametrize("fused_loss", [False, True], ids=["plain-loss", "fused-loss"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_head_saved_activations_match_the_planner_for_either_loss(autocast, fused_loss):
    """Without recomputation the whole micro batch within a few bytes, so the head's to the byte
    with either loss (they differ by megabytes: the plain loss keeps 4·V bytes a token)."""
    cfg = TOY
    measured = saved_bytes(_build(cfg, 0, fused_loss), cfg, MICRO_BATCH, autocast)
    predicted = micro_batch_activations(cfg, 1, 1, 0, MICRO_BATCH, autocast=autocast, fused_loss=fused_loss)
    assert abs(predicted.saved - measured) <= SELECTIVE_SLACK_BYTES, (predicted.saved, measured)


def test_checkpointing_saves_most_of_the_block_activations():
    """Independent of the planner: checkpointing every block keeps a fraction of the bytes."""
    full = saved_bytes(_build(GPT3_125M_SHORT, 0), GPT3_125M_SHORT, MICRO_BATCH, False)
    checkpointed = saved_bytes(_build(GPT3_125M_SHORT, 1), GPT3_125M_SHORT, MICRO_BATCH, False)
    assert checkpointed < 0.5 * full


def _tensor_parallel_saved(cfg_dict: dict) -> dict[tuple[bool, bool, bool], int]:
    """Saved bytes on this rank of a tp=2 GPT, by (sequence parallelism, selective recomputation,
    fused loss)."""
    from parallel.tensor import shard
    from parallel.topology import Topology

    cfg, topology, out = GPTConfig(**cfg_dict), Topology.create(tp=2), {}
    for sequence_parallel in (False, True):
        for selective in (False, True):
            for fused_loss in (False, True):
                modes = LayerModes(fused_loss=fused_loss, activation_checkpointing="selective" if selective else 0)
                with torch.device("meta"):
                    model = GPT(cfg, modes=modes)
                shard(model, topology, sequence_parallel=sequence_parallel).materialize("cpu", seed=0)
                out[sequence_parallel, selective, fused_loss] = saved_bytes(model, cfg, MICRO_BATCH, autocast=False)
    return out


def test_tensor_parallel_saved_activations_match_the_planner():
    """Within 10% without recomputation (in fact a few bytes), within a few bytes with selective
    recomputation or the fused loss."""
    cfg = dict(name="toy", n_layer=2, n_head=4, d_model=128, seq_len=128)
    for rank, measured in enumerate(run_distributed(_tensor_parallel_saved, 2, cfg)):
        for (sequence_parallel, selective, fused_loss), rank_bytes in measured.items():
            predicted = micro_batch_activations(GPTConfig(**cfg), 2, 1, 0, MICRO_BATCH, sequence_parallel=sequence_parallel,
                                                autocast=False, selective=selective, fused_loss=fused_loss)
            where = (rank, sequence_parallel, selective, fused_loss, predicted, rank_bytes)
            if selective or fused_loss:
                assert abs(predicted.saved - rank_bytes) <= SELECTIVE_SLACK_BYTES, where
            else:
                assert predicted.saved == pytest.approx(rank_bytes, rel=0.10), where


@pytest.mark.parametrize("fused_loss", [False, True], ids=["plain-loss", "fused-loss"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_selective_recomputation_saved_activations_match_the_planner(autocast, fused_loss):
    cfg = TOY
    measured = saved_bytes(_build(cfg, "selective", fused_loss), cfg, MICRO_BATCH, autocast)
    predicted = micro_batch_activations(cfg, 1, 1, 0, MICRO_BATCH, autocast=autocast, selective=True,
                                        fused_loss=fused_loss)
    assert abs(predicted.saved - measured) <= SELECTIVE_SLACK_BYTES, (predicted.saved, measured)
