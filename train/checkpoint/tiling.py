"""Whether the saved chunks of one tensor tile it exactly: every element in exactly one chunk.

A pure function of metadata (offsets and sizes), so it runs before any tensor data is read. Chunks
that all lie inside the tensor, overlap pairwise nowhere and whose volumes add up to the tensor's
cover every element exactly once: inside and disjoint means each element is covered at most once,
and the volumes then say no element is left out.
"""

from __future__ import annotations

import math

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def tiling_problem(full_shape: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """None when `chunks` tile a tensor of `full_shape` exactly once, else what is wrong, in words."""
    full_shape = tuple(full_shape)
    for offsets, sizes in chunks:
        if len(offsets) != len(full_shape) or len(sizes) != len(full_shape):
            return f"a chunk of {len(sizes)} dimensions in a tensor of {len(full_shape)}"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, full_shape)):
            return f"the chunk at {list(offsets)} of size {list(sizes)} reaches outside the shape {list(full_shape)}"
    solid = [(o, s) for o, s in chunks if math.prod(s) > 0]
    for i, (a_off, a_size) in enumerate(solid):
        for b_off, b_size in solid[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)):
                return f"the chunks at {list(a_off)} and {list(b_off)} overlap"
    covered = sum(math.prod(s) for _, s in solid)
    if covered != math.prod(full_shape):
        return f"its chunks cover {covered} of its {math.prod(full_shape)} elements"
    return None
