"""Generation at any layout: one decoding step over this rank's part of the model.

Every rank runs the same loop (model.generate.generate) with a LayoutDecoder, and every rank
ends each step knowing the next token:

  stage 0             embeds the unseen tokens, runs its blocks, sends the activations on
  stage s             receives them from stage s − 1, runs its blocks, sends them on
  last stage          runs its blocks, then the head on the last position only, gathers the
                      vocabulary shards of those logits (tp > 1), picks the token
  all stages          the last stage's token is broadcast over the pipeline group

The stages are virtual stages (parallel/schedules/placement.py): a rank holding several chunks runs each
in turn, passing the activations on in memory where the next stage is its own (the turn of zb-v's V).

Each rank's KVCache holds only its own blocks' keys and values (of its own heads under tensor
parallelism). A part built with sequence parallelism decodes through twins of its layers built
without it that share its parameters (a step of one token cannot be split over ranks): the same
weights then compute as plain tensor parallelism (parallel.build.decoding_layers). A one-process
model is a pipeline of one stage, so every layout runs this same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from model import GPTConfig
from model.decoding import Decoder
from model.kv_cache import KVCache
from parallel.build import decoding_layers
from parallel.pipeline import PipelineStages, StageSplit
from parallel.schedules.placement import Placement
from parallel.tensor import VocabParallelUnembedding, gather_logits


class LayoutDecoder(Decoder):
    """Decoder over this rank's part (a GPT or PipelineStages from parallel.build) of a model split
    by `topology`; see the module docstring."""

    def __init__(self, part: nn.Module, config: GPTConfig, topology):
        self.part, self.config, self.topology = part, config, topology
        layers = decoding_layers(part, config, topology)
        self.layers = list(layers.values())
        parameter = next(part.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        split = part.split if isinstance(part, PipelineStages) else StageSplit(Placement(1))
        self.placement, me = split.placement, topology.pp_rank
        # [(virtual stage, its layers)] of this rank, in order
        self.chunks = [(v, [layers[i] for i in chunk])
                       for v, chunk in zip(self.placement.stages_of(me), split.chunks(config.n_layer, me), strict=True)]
        self.last = self.placement.rank_of(self.placement.stages - 1) == me
        self.ranks = dist.get_process_group_ranks(topology.pp_group) if topology.pp_size > 1 else [0]  # by pp rank

    def next_token(self, tokens: torch.Tensor, cache: KVCache | None, pick) -> torch.Tensor:
        hidden = self.hidden_states(tokens, cache)  # (B, t, d) on the last stage, None elsewhere
        if self.last:  # only the last position reaches the head
            token = pick(self.full_logits(hidden[:, -1:])[:, 0].float())  # (B, 1)
        else:
            token = torch.empty(tokens.shape[0], 1, dtype=torch.long, device=self.device)
        return self.from_last_stage(token)

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor | None:
        """The unseen tokens (B, t) through every block of the layout, stage by stage: on the last
        stage the final hidden states (B, t, d), before the head; None on the other stages."""
        b, t = tokens.shape
        stages, rank_of, x = self.placement.stages, self.placement.rank_of, tokens  # (B, t) on stage 0
        for v, layers in self.chunks:
            if v > 0 and rank_of(v - 1) != rank_of(v):
                x = torch.empty(b, t, self.config.d_model, dtype=self.dtype, device=self.device)
                dist.recv(x, src=self.ranks[rank_of(v - 1)])  # (B, t, d)
            for layer in layers[:-1] if v == stages - 1 else layers:  # the head runs apart (full_logits)
                x = layer(x, cache=cache)  # (B, t, d)
            if v < stages - 1 and rank_of(v + 1) != rank_of(v):
                dist.send(x.to(self.dtype).contiguous(), dst=self.ranks[rank_of(v + 1)])
        if cache is not None:
            cache.advance(t)
        return x if self.last else None

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (B, t, V) of the last stage's hidden states (B, t, d):
        the head, then the vocabulary shards gathered (tp > 1)."""
        logits = self.layers[-1](hidden)  # (B, t, V or Vp/p)
        unembedding = self.layers[-1].lm_head
        if isinstance(unembedding, VocabParallelUnembedding):
            logits = gather_logits(logits, unembedding.group, unembedding.vocab_size)  # (B, t, V)
        return logits

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """`value` as the last stage holds it, on every stage (broadcast over the pipeline group);
        the other stages pass a tensor of its shape and dtype to receive it in."""
        if self.topology.pp_size > 1:
            last_rank = self.ranks[self.placement.rank_of(self.placement.stages - 1)]
            dist.broadcast(value, src=last_rank, group=self.topology.pp_group)
        return value
