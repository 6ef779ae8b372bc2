"""The three kinds of layer a GPT is a flat sequence of: Embedding, Block, Head.

Each maps one tensor to one tensor, so a pipeline can cut the sequence anywhere between layers:
  Embedding: token ids (B, T) → hidden (B, T, d)
  Block:     hidden → hidden, h + Attn(LN(h)) then h + MLP(LN(h))   (pre-LayerNorm)
  Head:      hidden → logits (B, T, V) = LN(h) Wᵀ, W tied to the token embedding; given the targets
             (B, T) too, hidden → their mean cross-entropy (the training loss, computed inside the Head)
The token embedding and the unembedding hold the vocabulary padded to Vp rows (model/vocab.py);
logits keep only the V real columns.
Attention reshapes heads with −1, so a column-sharded QKV projection just yields fewer local heads.
How a layer computes (its loss, its recomputation, which linears compute in float8) is fixed when it is built
(model/modes.py).
Each layer also takes an optional KVCache (model/kv_cache.py): the Embedding then numbers the new
tokens after those already seen, and attention attends to the cached keys and values as well.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import packed_attention
from model.config import GPTConfig
from model.modes import BLOCK_LINEARS, Fixed, Float8, LayerModes
from model.recompute import Linear, Recompute
from model.vocab import PaddedEmbedding, PaddedUnembedding
from model.weight_grads import WeightGradStore


class Embedding(nn.Module):
    """Token embedding (its vocabulary padded, model/vocab.py) plus learned absolute position embedding."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = PaddedEmbedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        start = 0 if cache is None else cache.seen
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, d)


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection.

    The QKV weight's output rows are ordered (head, {q, k, v}, d_head), so any contiguous slice of
    whole heads holds those heads' q, k and v together: that is what column parallelism cuts.
    """

    def __init__(self, config: GPTConfig, layer_index: int, qkv_fp8: Float8 | None = None,
                 proj_fp8: Float8 | None = None, weight_grads: WeightGradStore | None = None):
        super().__init__()
        self.layer_index = layer_index  # the block's index: its entry in a KVCache
        self.d_head = config.d_head
        self.window = config.window_of(layer_index)
        self.impl = config.attention_impl
        self.deterministic = config.deterministic_attention  # a backward whose bits do not depend on timing
        self.qkv = Linear(config.d_model, 3 * config.d_model, fp8=qkv_fp8, weight_grads=weight_grads)
        self.proj = Linear(config.d_model, config.d_model, fp8=proj_fp8, weight_grads=weight_grads)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache=None, recompute: Recompute | None = None) -> torch.Tensor:
        """recompute: how backward gets x back instead of keeping it (see model/recompute.py)."""
        qkv = self.qkv(x, recompute)  # (B, T, nh·3·hd); x may be this rank's piece of the sequence
        if cache is None:
            y = packed_attention(qkv, self.d_head, causal=True, window=self.window, impl=self.impl,
                                 deterministic=self.deterministic)  # (B, T, nh·hd)
        else:  # the new queries against the cached keys and the new ones
            b, t, _ = qkv.shape
            q, k, v = qkv.view(b, t, -1, 3, self.d_head).permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hd)
            y = cache.attend(self.layer_index, q, k, v, window=self.window, impl=self.impl)  # (B, nh, T, hd)
            y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, nh·hd)
        return self.drop(self.proj(y))  # (B, T, d)


class MLP(nn.Module):
    """d → d_ff → d with GELU (tanh approximation, as GPT-2/3) or ReLU."""

    def __init__(self, config: GPTConfig, fc_fp8: Float8 | None = None, proj_fp8: Float8 | None = None,
                 weight_grads: WeightGradStore | None = None):
        super().__init__()
        self.fc = Linear(config.d_model, config.d_ff, fp8=fc_fp8, weight_grads=weight_grads)
        self.proj = Linear(config.d_ff, config.d_model, fp8=proj_fp8, weight_grads=weight_grads)
        self.act = nn.GELU(approximate="tanh") if config.activation == "gelu" else nn.ReLU()
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None, recompute_act: bool = False) -> torch.Tensor:
        """recompute: how backward gets x back instead of keeping it; recompute_act: proj's backward
        recomputes GELU(fc output) from the fc output (which the GELU's backward keeps anyway)."""
        f = self.fc(x, recompute)  # (B, T, d_ff)
        a = self.act(f)  # (B, T, d_ff)
        return self.drop(self.proj(a, Recompute(self.act, f) if recompute_act else None))  # (B, T, d)


class Block(nn.Module):
    """One pre-LayerNorm transformer block.

    Built with `selective_recomputation` (parallel.activation_checkpointing=selective; Korthikanti et
    al. 2022) and gradients enabled, backward recomputes three tensors instead of keeping them: the
    outputs of ln_1 and ln_2 (the inputs of attn.qkv and mlp.fc), from the LayerNorm input that the
    LayerNorm's backward keeps anyway, and the GELU output (the input of mlp.proj), from the fc output
    that the GELU's backward keeps anyway. Every matrix product and every collective runs once; the
    attention core is recomputed by the attention kernel itself, as without this mode. Per block and
    micro batch of B sequences of T tokens, in elements of the activation dtype, on one of p = tp ranks:

        kept = kept without recomputation − (2·B·T·d + B·T·d_ff/p)         without sequence parallelism
        kept = kept without recomputation − B·T·d_ff/p                      with sequence parallelism

    A sequence-parallel LayerNorm's output is all-gathered over the tp ranks before the column layer
    uses it, so recomputing it would repeat the all-gather: those outputs are kept. With ReLU instead
    of GELU the activation keeps its own output for backward, so nothing is gained there and the
    MLP's activation output is kept too (only the 2·B·T·d term applies).

    Built with `fp8` (a Float8 mode, train.precision=fp8), the linears named in `fp8_linears` (of
    attn.qkv, attn.proj, mlp.fc, mlp.proj: model.modes.BLOCK_LINEARS; all four unless told) compute their
    forward, input-gradient and weight-gradient products in float8 (model/float8.py); the other linears,
    the LayerNorms, the attention and the GELU stay in the compute dtype.

    Built with `weight_grads` (a model.weight_grads.WeightGradStore, parallel.pipeline_schedule=zb-h1),
    the same four linears leave their weight and bias gradients to the store, which the pipeline schedule
    drains later; the LayerNorms' gradients are computed in the backward as always.
    """

    selective_recomputation = Fixed()

    def __init__(self, config: GPTConfig, layer_index: int, selective_recomputation: bool = False,
                 fp8: Float8 | None = None, weight_grads: WeightGradStore | None = None,
                 fp8_linears=BLOCK_LINEARS):
        super().__init__()
        mode = LayerModes(fp8=fp8, fp8_linears=frozenset(fp8_linears)).fp8_of  # linear's name → its Float8 or None
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.attn = SelfAttention(config, layer_index, mode("attn.qkv"), mode("attn.proj"), weight_grads)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.mlp = MLP(config, mode("mlp.fc"), mode("mlp.proj"), weight_grads)
        self.selective_recomputation = selective_recomputation

    def forward(self, h: torch.Tensor, cache=None) -> torch.Tensor:
        if not (self.selective_recomputation and cache is None and torch.is_grad_enabled()):
            h = h + self.attn(self.ln_1(h), cache)  # (B, T, d)
            return h + self.mlp(self.ln_2(h))  # (B, T, d)
        h = h + self.attn(self.ln_1(h), recompute=self._norm_recompute(self.ln_1, h))  # (B, T, d)
        recompute_act = isinstance(self.mlp.act, nn.GELU)
        return h + self.mlp(self.ln_2(h), self._norm_recompute(self.ln_2, h), recompute_act)  # (B, T, d)

    @staticmethod
    def _norm_recompute(norm: nn.Module, h: torch.Tensor) -> Recompute | None:
        """norm(h) recomputed in backward, unless norm gathers its output over ranks (see class docstring)."""
        return None if getattr(norm, "sequence_parallel", False) else Recompute(norm, h)


class Head(nn.Module):
    """Final LayerNorm and the unembedding; `lm_head.weight` is tied to `Embedding.wte.weight`.

    forward(h) gives the logits (B, T, V); forward(h, targets) the training loss, their mean
    cross-entropy, computed here, inside the model's (or the last pipeline stage's) forward, so that
    the loss's use of the tied weight happens inside whatever wraps that forward (ZeRO-3's gathers,
    DeepSpeed's backward hooks on the output). How it is computed is the unembedding's mode, fixed
    when the Head is built (fused_loss: chunk by chunk without the full logits, model/fused_loss.py).
    With gradients on the loss is flagged (flag_non_finite), so a non-finite loss makes the whole
    gradient non-finite.
    """

    def __init__(self, config: GPTConfig, fused_loss: bool = False):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.lm_head = PaddedUnembedding(config.d_model, config.vocab_size, fused_loss=fused_loss)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        h = self.ln_f(h)  # (B, T, d); nothing of the head is cached
        if targets is None:
            return self.lm_head(h)  # (B, T, V) (a vocab-parallel unembedding: this rank's (B, T, Vp/p))
        loss = self.lm_head.loss(h, targets)  # scalar
        return flag_non_finite(loss) if torch.is_grad_enabled() else loss


def flag_non_finite(loss: torch.Tensor) -> torch.Tensor:
    """loss · f with f = (ℓ − ℓ) + 1 of the detached loss ℓ: exactly 1 when the loss is finite, NaN when it is
    not (∞ − ∞ and NaN − NaN are NaN), with no host sync and three small kernels. Every gradient of a
    non-finite loss is then NaN, on this rank and, through the gradient reductions, on every rank, so the
    optimizers' norm check skips the step everywhere (train/guard/nonfinite.py). For a finite loss the
    factor is exactly 1: the gradient is bit for bit what it was without it."""
    value = loss.detach()
    return loss * ((value - value) + 1)
