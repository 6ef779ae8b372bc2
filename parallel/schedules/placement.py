"""Where a pipeline's stages run: virtual stages, the chunks of consecutive layers a micro batch passes
through in order, placed on the pipeline's ranks.

With pp ranks and V chunks a rank there are P = pp·V virtual stages, numbered in the order a forward
visits them (virtual stage 0 holds the Embedding, P − 1 the Head and loss):

    loop   (1f1b, zb-h1 with V = 1; interleaved)   virtual stage v on rank v mod pp
           pp = 2, V = 2:   rank 0: v 0, 2     rank 1: v 1, 3       a micro batch goes 0 → 1 → 0 → 1
    v      (zb-v, V = 2)                           rank r holds v = r and v = 2·pp − 1 − r
           pp = 2:          rank 0: v 0, 3     rank 1: v 1, 2       a micro batch goes 0 → 1 → 1 → 0

A rank's chunks are its virtual stages in increasing order, chunk c being the c-th; a message between
consecutive virtual stages on one rank (the turn of the V) is a hand-off in memory, not a send.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

LOOP, V_SHAPE = "loop", "v"


@dataclass(frozen=True)
class Placement:
    """pp ranks holding `virtual` chunks each, placed by `shape` (LOOP or V_SHAPE)."""

    pp: int
    virtual: int = 1
    shape: str = LOOP

    def __post_init__(self):
        if self.pp < 1 or self.virtual < 1:
            raise ValueError(f"a pipeline needs pp ≥ 1 and virtual stages ≥ 1, not pp={self.pp}, V={self.virtual}")
        if self.shape not in (LOOP, V_SHAPE):
            raise ValueError(f"placement shape {self.shape!r}: must be {LOOP!r} or {V_SHAPE!r}")
        if self.shape == V_SHAPE and self.virtual != 2:
            raise ValueError(f"a V placement holds 2 chunks a rank, not {self.virtual}")

    @property
    def stages(self) -> int:
        """P: the number of virtual stages."""
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding virtual stage `stage`."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"virtual stage {stage}: the pipeline has {self.stages}")
        if self.shape == LOOP:
            return stage % self.pp
        return stage if stage < self.pp else 2 * self.pp - 1 - stage

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages `rank` holds, in increasing order (its chunks 0, 1, …)."""
        return _stages_of(self, rank)

    def chunk_of(self, stage: int) -> int:
        """The index of virtual stage `stage` among its rank's chunks."""
        return self.stages_of(self.rank_of(stage)).index(stage)


@lru_cache(maxsize=4096)
def _stages_of(placement: Placement, rank: int) -> tuple[int, ...]:
    return tuple(v for v in range(placement.stages) if placement.rank_of(v) == rank)
