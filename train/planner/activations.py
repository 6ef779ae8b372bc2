"""Activation memory of one micro batch on one rank: the tensors autograd keeps for backward,
counted from what gpt3d's layers actually save.

Notation: n = b·T tokens of one micro batch, d = d_model, f = d_ff, h = n_head, p = tp, σ = p with
sequence parallelism (else 1); a = bytes of a matmul input (2 in bf16: autocast or bf16 weights on
a GPU; 4 in fp32 on a CPU), r = bytes of the residual stream (4 with fp32 weights, 2 with bf16
weights), and 4 for LayerNorm statistics and softmax outputs.
Per token of each transformer block (model/layers.py through parallel/tensor.py):

  ln_1, ln_2      input (r·d/σ each) and mean, rstd (2·4/σ each)
  qkv, fc         input as the matmul reads it: a·d each (gathered to the full sequence under σ)
  attention       q, k, v (3a·d/p: the QKV projection's output, one storage), the output o with its
                  heads merged (a·d/p: the tensor the output projection reads, model/attention_op.py),
                  log-sum-exp (4h/p)
  MLP             GELU input and output (2a·f/p; ReLU keeps one)
  ─────────────   (r·2/σ + a·2 + 4a/p)·d + 2a·f/p + 16/σ + 4h/p bytes

Selective recomputation (parallel.activation_checkpointing=selective) keeps neither LayerNorm's
output (the qkv and fc inputs, 2a·d) nor GELU's (a·f/p): backward recomputes them from the kept
LayerNorm input and statistics and the kept fc output. Under sequence parallelism the matmul
inputs are the gathered LayerNorm outputs and stay; only GELU's output goes.

The embedding keeps its token ids (8 bytes a token; tp > 1 also a byte of mask); the head keeps the
final LayerNorm's input and statistics, and what the loss (train.fused_loss) keeps. The unembedding
W has Vp/p rows on a rank (the vocabulary V padded to a multiple of 128·p, model/vocab.py, also at
p = 1). Dropout with p = 0 saves nothing.

  fused loss      ∂L/∂h (n, d) in the matmul dtype and ∂L/∂W (Vp/p, d) in fp32, made in the forward
                  (model/fused_loss.py): a·d a token (the full sequence under σ) and 4·(Vp/p)·d a micro batch
  plain loss      the unembedding's input (a·d) and the log-softmax (4·V; at p > 1 the vocab-parallel
                  softmax, 4·Vp/p, and its target index and masks, 10 bytes), plus the targets (8)

What either loss holds only while it runs is `loss_transient`.
Under a pipeline (DeepSpeed's 1F1B engine and gpt3d's ScheduleEngine alike) every stage but the last
keeps its output until backward (r·d, or with tp > 1 the 1/p piece it sent). Each stage also keeps what
it was loaded or sent until its backward and runs its forward on a copy (PipelineEngine's forward pass):
the first stage keeps the token ids and targets (2·8 bytes a token) beside the copies its embedding saves
and passes on; every other stage keeps the activation it received (r·d/σ) and the targets (8) beside
their copies, unless the activation came in tp pieces (tp > 1 without sequence parallelism), whose
gathered whole replaces them. The targets' copy travels on (8) to the last stage, where the plain loss at p = 1
flattens it in place (its flattened targets, counted above, are that copy), the vocab-parallel loss keeps it
beside its target index, and the fused loss lets it go. Pieces sent under tp > 1 without σ also keep their
metadata (8·(p + 7) bytes a micro batch).
DeepSpeed's 1F1B engine also keeps each loss on the last stage after its backward, until its buffer's next
forward, and the loss's graph keeps the stage's input (autograd's leaf): the received activation of up to two
earlier micro batches (`received_activation_bytes`); gpt3d's ScheduleEngine lets go of them.

Under ZB-H1 (parallel.pipeline_schedule=zb-h1) each block linear's backward defers its weight gradient
gᵀ·x (model/weight_grads.py), keeping its input x (a matmul input, a bytes) and its output gradient g (cast
to the matmul dtype) until the W pass runs: per token of a block, x of qkv and fc a·d each (gathered under
σ), of attn.proj a·d/p and of mlp.proj a·f/p; g of qkv a·3d/p, of fc a·f/p, and of both row-parallel
layers a·d (their output is whole on every rank before its sum): a·(4d + (4d + 2f)/p) bytes
(`deferred_weight_grad_bytes`). After B these are all that is left of the micro batch's activations.

Activation checkpointing keeps only each checkpointed segment's input (4d/σ a token) and recomputes
the rest during backward, when one segment's full activations exist again (`recompute`). On a GPU,
autocast casts every fp32 weight matrix to bf16 once per micro batch and the matmuls keep those
casts for backward (`weight_copies`: 2 bytes per matrix element of the layers not checkpointed);
in fp32, and with bf16 weights, the saved weights are the parameters themselves and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from model import GPTConfig
from model.fused_loss import token_chunk
from model.vocab import padded_vocab_size
from train.planner.counts import rank_parameters, stage_blocks, stage_layers

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class StageShape:
    """What a pipeline stage runs, in order: the embedding, some blocks, the head (final norm,
    unembedding and loss); pipelined: under DeepSpeed's pipeline engine (pp > 1)."""

    embedding: bool
    blocks: int
    head: bool
    pipelined: bool

    @classmethod
    def of(cls, config: GPTConfig, pp: int, stage: int, blocks: tuple[int, ...] | None = None) -> "StageShape":
        """(virtual) `stage` of `pp`, `blocks` as counts.stage_layers takes them."""
        layers = stage_layers(config.n_layer, pp, stage, blocks)
        return cls(0 in layers, len(stage_blocks(config.n_layer, pp, stage, blocks)), config.n_layer + 1 in layers,
                   pp > 1)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of one micro batch on one stage (see module docstring).

    saved: kept from its forward until its backward (what pp − stage micro batches in flight each
    hold under 1F1B); weight_copies: autocast's bf16 weight casts among them (0 in fp32);
    recompute: extra bytes while one checkpointed segment is recomputed and run backward;
    per_block: one block's saved bytes without checkpointing; cast_transient: all of the stage's
    weight casts, alive during a forward (autocast caches them until it exits); loss_transient: the
    loss's bytes beyond the saved ones while it runs, forward or backward (0 without the head).
    """

    saved: int
    weight_copies: int
    recompute: int
    per_block: int
    cast_transient: int
    loss_transient: int = 0

    @property
    def activations(self) -> int:
        return self.saved - self.weight_copies


def block_bytes_per_token(
    config: GPTConfig, tp: int, sequence_parallel: bool, a: int, r: int = FP32, selective: bool = False,
    ring_float8: tuple = (),
) -> float:
    """Saved bytes a token costs in one transformer block (module docstring's sum). ring_float8: the block
    linears that keep their input in float8 (a byte an element) under the ring overlap."""
    d, f, h = config.d_model, config.d_ff, config.n_head
    sigma = tp if sequence_parallel else 1
    layer_norms = 2 * (r * d + 2 * FP32) / sigma
    matmul_inputs = 0 if selective and not sequence_parallel else sum(
        (1 if name in ring_float8 else a) * d for name in ("attn.qkv", "mlp.fc"))
    attention = 4 * a * d / tp + FP32 * h / tp + (d / tp if "attn.proj" in ring_float8 else 0)
    gelu = config.activation == "gelu"
    mlp = a * f / tp  # GELU's input (ReLU's output)
    if not selective and "mlp.proj" in ring_float8:
        mlp += f / tp  # mlp.proj's float8 input, instead of GELU's output
    elif gelu and not selective:
        mlp += a * f / tp  # GELU's output, mlp.proj's input
    return layer_norms + matmul_inputs + attention + mlp


def _embedding_bytes_per_token(tp: int) -> float:
    return INT64 + (1 if tp > 1 else 0)


def unembedding_rows(config: GPTConfig, tp: int) -> int:
    """Vp/p: the unembedding's rows on one rank, padding included (model/vocab.py)."""
    return padded_vocab_size(config.vocab_size, tp) // tp


def _head_bytes(config: GPTConfig, tp: int, sequence_parallel: bool, a: int, r: int, n: int, fused_loss: bool) -> float:
    """Saved bytes of the head for n tokens: the final LayerNorm's, then the loss's (module docstring)."""
    sigma = tp if sequence_parallel else 1
    d = config.d_model
    norm = (r * d + 2 * FP32) / sigma * n
    if fused_loss:
        return norm + a * n * d + FP32 * unembedding_rows(config, tp) * d  # ∂L/∂h, ∂L/∂W
    if tp > 1:
        loss = FP32 * unembedding_rows(config, tp) + INT64 + 2  # softmax, target index, masks
    else:
        loss = FP32 * config.vocab_size + INT64  # log-softmax output and the flattened targets
    return norm + (a * d + loss) * n


def loss_transient(config: GPTConfig, tp: int, n: int, a: int, r: int, fused_loss: bool) -> int:
    """Bytes the loss of n tokens holds beyond what it saves, at the larger of its forward's and its
    backward's peaks on a rank; a: the matmul dtype's bytes, r: the residual stream's and the
    weights' (a < r: autocast). Tensors of Vp/p = Vl columns or d-sized rows; per-token vectors
    (targets, masks, maxima) left out. Read off the code as written:

    fused (model/fused_loss.py), C = token_chunk(n, Vl, a) tokens a chunk:
      forward   under autocast the casts of h and W (a·(n + Vl)·d), plus one chunk's logits (a·C·Vl),
                which its gradient overwrites; on a GPU ∂L/∂W's products sum in fp32 into ∂L/∂W itself
      backward  ∂L/∂h·∂out/∂L (a·n·d, and its cast to h's r when r ≠ a), then ∂L/∂W·∂out/∂L (4·Vl·d,
                and its cast to r when r < 4) beside the returned ∂L/∂h (r·n·d)
    plain, p = 1 (model/vocab.py's unembedding, then model/layers.py lm_loss):
      forward   the logits (a·n·Vp) and their fp32 copy cut to V columns (4·n·V when a < 4)
      backward  the gradients of nll_loss and of log_softmax (4·n·V each), or later the logits'
                gradient cut and padded back (a·n·V + a·n·Vp)
    plain, p > 1 (parallel/tensor.py _VocabParallelCrossEntropy, on the rank holding padding):
      forward   the logits (a·n·Vl), their fp32 copy (4·n·Vl when a < 4) and its clone for the
                padding columns (4·n·Vl when Vp > V)
      backward  the softmax's clone (4·n·Vl) and its cast to the logits' dtype (a·n·Vl when a < 4)
    """
    d, vocab = config.d_model, config.vocab_size
    rows = unembedding_rows(config, tp)
    cast = a if a < FP32 else 0  # bytes of a bf16 copy of an fp32 tensor (none in fp32)
    copy = FP32 if a < FP32 else 0  # bytes of an fp32 copy of a bf16 tensor (none in fp32)
    if fused_loss:
        inputs = a * (n + rows) * d if a < r else 0
        forward = inputs + a * token_chunk(n, rows, a) * rows
        h_cast = r * n * d if r != a else 0
        w_cast = r * rows * d if r < FP32 else 0
        backward = max(a * n * d + h_cast, r * n * d + FP32 * rows * d + w_cast)
        return max(forward, backward)
    if tp == 1:
        forward = a * n * rows + copy * n * vocab  # logits (n, Vp), their fp32 copy (n, V)
        backward = max(2 * FP32 * n * vocab, a * n * (vocab + rows))
        return max(forward, backward)
    padded = rows * tp > vocab
    forward = (a + copy + (FP32 if padded else 0)) * n * rows
    backward = (FP32 + cast) * n * rows
    return max(forward, backward)


def deferred_weight_grad_bytes(config: GPTConfig, tp: int, pp: int, stage: int, micro_batch: int, a: int,
                               blocks: tuple[int, ...] | None = None, ring_float8: tuple = ()) -> int:
    """Bytes one micro batch's deferred W pass holds on `stage` under ZB-H1: every block linear's input and
    output gradient, a·(4d + (4d + 2f)/p) a token of each block (module docstring); a: the matmul dtype's
    bytes. Under the ring overlap the linears of ring_float8 hold their input, and a row layer its gathered
    output gradient, in float8 (a byte), and a column layer its output gradient in float8 beside the one its
    bias gradient sums. What fp8's products keep of their own beyond these (amaxes, scales) is not counted."""
    d, f, n = config.d_model, config.d_ff, micro_batch * config.seq_len
    shapes = {"attn.qkv": (d, 3 * d // tp, True), "mlp.fc": (d, f // tp, True),
              "attn.proj": (d // tp, d, False), "mlp.proj": (f // tp, d, False)}  # (input, output, column)
    per_token = 0
    for name, (k, m, column) in shapes.items():
        if name not in ring_float8:
            per_token += a * (k + m)
        else:
            per_token += k + ((a + 1) * m if column else m)
    return StageShape.of(config, pp, stage, blocks).blocks * n * per_token


def checkpointed_blocks(shape: StageShape, k: int) -> int:
    """Blocks of the stage inside checkpointed segments: every run of up to k consecutive blocks, at
    any pp (model.gpt.run_layers, which a whole GPT and a pipeline stage both run)."""
    return shape.blocks if k > 0 else 0


def checkpointed_segments(shape: StageShape, k: int) -> int:
    return -(-checkpointed_blocks(shape, k) // k) if k > 0 else 0


def received_activation_bytes(config: GPTConfig, tp: int, sequence_parallel: bool, micro_batch: int, r: int) -> int:
    """The activation a pipeline stage's forward gets from the one before, as autograd's leaf: what it was sent
    (r·d a token, under σ its sequence part), or with tp > 1 without σ the whole gathered from the tp pieces sent."""
    sigma = tp if sequence_parallel else 1
    return r * config.d_model * micro_batch * config.seq_len // sigma


def micro_batch_activations(
    config: GPTConfig, tp: int, pp: int, stage: int, micro_batch: int, *, sequence_parallel: bool = False,
    checkpoint_every: int = 0, autocast: bool = True, bf16_weights: bool = False, selective: bool = False,
    fused_loss: bool = True, blocks: tuple[int, ...] | None = None, ring_float8: tuple = (),
) -> ActivationBytes:
    """Activation bytes of one micro batch of `micro_batch` sequences on `stage` (module docstring).

    autocast: matmuls in bf16 (a = 2); bf16_weights: the parameters themselves are bf16 (r = 2, no
    weight casts; implies bf16 matmuls); selective: selective recomputation in every block;
    fused_loss: train.fused_loss (the loss unembeds chunk by chunk) or the plain loss. (pp, stage, blocks):
    a virtual stage as counts.stage_layers takes it. ring_float8: the block linears in float8 under the ring
    overlap (block_bytes_per_token)."""
    a = 2 if autocast or bf16_weights else FP32
    r = 2 if bf16_weights else FP32
    n = micro_batch * config.seq_len
    shape = StageShape.of(config, pp, stage, blocks)
    per_block = block_bytes_per_token(config, tp, sequence_parallel, a, r, selective, ring_float8) * n
    ckpt_blocks = checkpointed_blocks(shape, checkpoint_every)
    segments = checkpointed_segments(shape, checkpoint_every)
    sigma = tp if sequence_parallel else 1
    saved = per_block * (shape.blocks - ckpt_blocks) + segments * r * config.d_model * n / sigma
    if shape.embedding:
        saved += _embedding_bytes_per_token(tp) * n + INT64 * config.seq_len  # ids, position ids
    if shape.head:
        saved += _head_bytes(config, tp, sequence_parallel, a, r, n, fused_loss)
    partitioned = tp > 1 and not sequence_parallel  # DeepSpeed's pipe partitioning: activations sent in tp pieces
    if shape.pipelined and not shape.head:
        # the stage output the engine keeps (tp > 1: its 1/tp part, or under σ its own sequence part), and the
        # targets' copy travelling with it to the last stage (parallel/pipeline.py)
        saved += (r * config.d_model / tp + INT64) * n
        if partitioned:  # the pieces' metadata: ndim, the 3 sizes, parts, rank and the tp + 1 offsets
            saved += INT64 * (tp + 7)
    if shape.pipelined and shape.head and not fused_loss and tp > 1:
        saved += INT64 * n  # the targets' copy, which the vocab-parallel loss keeps beside its target index
    if shape.pipelined:  # what the stage was loaded or sent, kept beside the copy its forward runs on
        if shape.embedding:
            saved += 2 * INT64 * n  # token ids and targets
        elif not partitioned:  # else the activation's gathered whole replaces the pieces received
            saved += (received_activation_bytes(config, tp, sequence_parallel, micro_batch, r) + INT64 * n)
    copies = transient = block_casts = 0
    if autocast and not bf16_weights:
        copies, transient, block_casts = _weight_casts(config, tp, pp, stage, shape, ckpt_blocks, fused_loss, blocks)
    recompute = (per_block + block_casts) * min(checkpoint_every, ckpt_blocks)
    loss = loss_transient(config, tp, n, a, r, fused_loss) if shape.head else 0
    return ActivationBytes(round(saved) + copies, copies, round(recompute), round(per_block), transient, loss)


def _weight_casts(config: GPTConfig, tp: int, pp: int, stage, shape: StageShape, ckpt_blocks: int, fused_loss: bool,
                  blocks: tuple[int, ...] | None = None) -> tuple[int, int, int]:
    """Bytes of bf16 weight casts: (saved for backward, all made during one forward, one block's).
    The fused loss casts the unembedding itself, outside autocast's cache (in its loss_transient)."""
    params = rank_parameters(config, tp, pp, stage, blocks)
    in_blocks = [p for p in params if ".attn." in p.name or ".mlp." in p.name]
    block_matrices = sum(p.numel for p in in_blocks if p.decay) // max(shape.blocks, 1)
    block_vectors = sum(p.numel for p in in_blocks if not p.decay)
    autocast_unembedding = shape.head and not fused_loss
    unembedding = sum(p.numel for p in params if p.tied) if autocast_unembedding else 0
    saved = 2 * (block_matrices * (shape.blocks - ckpt_blocks) + unembedding)
    transient = 2 * (block_matrices * shape.blocks + block_vectors + unembedding)
    return saved, transient, 2 * block_matrices
