"""How layers go to pipeline stages: the GPT's flat layer list as a DeepSpeed PipelineModule.

    stage 0                     stages …                    last stage
    Embedding (tied) → Block … │ Block … │ … Block → FinalNorm → Embedding.unembed (tied) → loss

Blocks are balanced over `pp` stages by count (partition "type:PipeBlock"). The token embedding
matrix lives on the first stage and, as the unembedding, on the last: DeepSpeed's TiedLayerSpec
builds it on both and all-reduces its gradient between them. Each stage builds only its own
layers: each is constructed on the meta device, tensor-parallel sharded, then allocated and
initialised with its index in the full layer list, so the weights are the one-process model's
(model/init.py) whatever the (tp, pp) layout.
"""

from __future__ import annotations

import torch
from torch import nn

from model import GPTConfig
from model.init import init_layer_, materialize_
from model.layers import Block, Embedding, lm_loss
from parallel.tensor import shard_layer, tied_unembedding, vocab_parallel_loss


class _Materialized:
    """Mixin: a layer built on meta is sharded, then allocated on `device` and its weights drawn."""

    def _finish(self, layer_index: int, config: GPTConfig, topology, seed: int, device):
        shard_layer(self, topology)
        materialize_(self, device)
        init_layer_(self, layer_index, seed, config.n_layer, config.init_std)


class PipeEmbedding(_Materialized, Embedding):
    """Layer 0: token + position embedding; on the last stage its `unembed` gives the logits."""

    def __init__(self, config: GPTConfig, topology, seed: int, device):
        with torch.device("meta"):
            Embedding.__init__(self, config)
        self._finish(0, config, topology, seed, device)
        self.unembedding = tied_unembedding(self.wte, config.vocab_size, topology)  # its weight is wte.weight

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.unembedding(h)  # (B, T, V) or, tensor-parallel, (B, T, Vp/tp)


class PipeBlock(_Materialized, Block):
    """Layer 1 + i of the full list: transformer block i."""

    def __init__(self, config: GPTConfig, block_index: int, topology, seed: int, device):
        with torch.device("meta"):
            Block.__init__(self, config, block_index)
        self._finish(1 + block_index, config, topology, seed, device)


class PipeFinalNorm(_Materialized, nn.Module):
    """The Head's LayerNorm (layer L + 1, parameter names `ln_f.*`, as in model.layers.Head)."""

    def __init__(self, config: GPTConfig, topology, seed: int, device):
        nn.Module.__init__(self)
        with torch.device("meta"):
            self.ln_f = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self._finish(config.n_layer + 1, config, topology, seed, device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h)  # (B, T, d)


def _unembed(module: PipeEmbedding, h: torch.Tensor) -> torch.Tensor:
    return module.unembed(h)


def build_pipeline(config: GPTConfig, topology, seed: int, device, checkpoint_every: int = 0):
    """A deepspeed PipelineModule over topology's pp stages, holding only this stage's layers.

    checkpoint_every=k recomputes activations in backward for every k blocks (0: keep them all).
    Sequence parallelism is not combined with pipelining (trainer refuses the combination).
    """
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    common = (topology, seed, device)
    layers = [
        TiedLayerSpec("embedding", PipeEmbedding, config, *common, tied_weight_attr=["wte.weight"]),
        *(LayerSpec(PipeBlock, config, i, *common) for i in range(config.n_layer)),
        LayerSpec(PipeFinalNorm, config, *common),
        TiedLayerSpec("embedding", PipeEmbedding, config, *common, forward_fn=_unembed, tied_weight_attr=["wte.weight"]),
    ]
    return PipelineModule(
        layers=layers,
        topology=topology.grid_topology,
        loss_fn=vocab_parallel_loss(config.vocab_size, topology) if topology.tp_size > 1 else lm_loss,
        partition_method="type:PipeBlock",
        activation_checkpoint_interval=checkpoint_every,
        checkpointable_layers=["PipeBlock"],
    )
