"""How a layer computes, fixed when it is built.

A layer's mode (a Head's loss, a Block's recomputation, a tensor-parallel layer's overlap or sequence
split) is given to its constructor and never changes afterwards: the layer's forward is the one its
modes chose, whoever holds the layer. `Fixed` makes such an attribute settable once, in `__init__`;
a later assignment raises, naming the attribute and where the mode is chosen instead.

`LayerModes` is what the model's own layers take (parallel.build.BuildOptions adds the
tensor-parallel ones):
  fused_loss                 the Head's loss unembeds its hidden states chunk by chunk, never making
                             the (N, V) logits (model/fused_loss.py); else logits, then cross-entropy
  activation_checkpointing   0: keep every activation; k > 0: each run of k consecutive blocks keeps
                             only its input and recomputes inside in backward; "selective": every
                             block recomputes its LayerNorm and GELU outputs (model.layers.Block)
  fp8                        a Float8: the blocks' linears named in fp8_linears compute their three
                             products each in float8 (model/float8.py), by its recipe; None: every
                             linear in the compute dtype (train.precision=fp8 sets it from
                             train.fp8_recipe and the device)
  fp8_linears                which of a block's linears (BLOCK_LINEARS) the fp8 mode applies to; the
                             others compute in the compute dtype (train.precision=fp8: the linears
                             whose product shapes make float8 faster, train/planner/fp8_rule.py)
  weight_grads               a model.weight_grads.WeightGradStore: the blocks' four linears leave their
                             weight gradients to it, for a zero-bubble pipeline schedule to run later
                             (parallel.pipeline_schedule=zb-h1); None: computed in the backward
"""

from __future__ import annotations

from dataclasses import dataclass, field

SELECTIVE = "selective"  # the activation_checkpointing mode that recomputes LayerNorm and GELU outputs only
# A block's linear layers, by their names inside the block: the fused QKV projection and the attention's output
# projection (column- and row-parallel under tensor parallelism), the MLP's up and down projections (likewise)
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


@dataclass(frozen=True)
class Float8:
    """How a linear layer's float8 products run (model/float8.py): `recipe` "tensorwise" or "rowwise";
    `emulate`: the product of the float8 operands as an fp32 matrix multiply of their exact values
    (torchao's emulation) instead of torch._scaled_mm, whose CPU kernel is about a thousand times slower
    than an fp32 one; the same quantized operands, the sums rounded in another order. `weight_casts`: a
    model.float8_weights.WeightCasts (this rank's own object, not part of the mode's value) that keeps each
    weight's float8 casts through a training step (None: every micro batch casts them again)."""

    recipe: str = "tensorwise"
    emulate: bool = False
    weight_casts: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class LayerModes:
    """The modes the model's layers are built with (see the module docstring)."""

    fused_loss: bool = False
    activation_checkpointing: int | str = 0
    fp8: Float8 | None = None
    weight_grads: object | None = None  # a model.weight_grads.WeightGradStore (this rank's own object)
    fp8_linears: frozenset = frozenset(BLOCK_LINEARS)  # the block linears `fp8` applies to

    def __post_init__(self) -> None:
        check_block_linears(self.fp8_linears, "fp8_linears")
        object.__setattr__(self, "fp8_linears", frozenset(self.fp8_linears))

    def fp8_of(self, linear: str) -> Float8 | None:
        """The float8 mode of the block linear `linear` (a name of BLOCK_LINEARS): `fp8` where it is one of
        fp8_linears, else None (the compute dtype)."""
        return self.fp8 if linear in self.fp8_linears else None

    @property
    def selective(self) -> bool:
        return self.activation_checkpointing == SELECTIVE

    @property
    def checkpoint_every(self) -> int:
        """k: blocks per recomputed segment (0: none; selective recomputation recomputes inside each block)."""
        return 0 if self.selective else int(self.activation_checkpointing)


def check_block_linears(names, key: str) -> None:
    """ValueError, one line naming `key`, unless `names` are distinct names of BLOCK_LINEARS."""
    names = list(names)
    unknown = [n for n in names if n not in BLOCK_LINEARS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"{key}={names!r}: must be distinct names of a block's linears, from {list(BLOCK_LINEARS)}")


class Fixed:
    """A mode attribute of a module: assigned once (when the module is built), read-only afterwards."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, f"_fixed_{name}"

    def __get__(self, module, owner=None):
        if module is None:
            return self
        return module.__dict__[self.slot]

    def __set__(self, module, value) -> None:
        if self.slot in module.__dict__:
            raise AttributeError(
                f"{type(module).__name__}.{self.name} is fixed when the layer is built; build the layer "
                f"with the mode wanted (parallel.build.BuildOptions, model.modes.LayerModes) instead of changing it"
            )
        module.__dict__[self.slot] = value
