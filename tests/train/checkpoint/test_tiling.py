"""`tiling_problem` accepts exactly the chunk layouts that cover every element of a tensor once.

Random layouts of small tensors (exact tilings cut from a grid, then with chunks moved, grown,
shrunk, dropped or duplicated) are judged against a brute-force count of how many chunks cover each
element: a layout is an exact tiling when every count is 1 and no chunk reaches outside.
"""

from __future__ import annotations

import itertools
import random

import pytest

from train.checkpoint.tiling import tiling_problem


def brute_force_exact(shape, chunks) -> bool:
    counts = dict.fromkeys(itertools.product(*(range(n) for n in shape)), 0)
    for offsets, sizes in chunks:
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return False
        for element in itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))):
            counts[element] += 1
    return all(c == 1 for c in counts.values())


def grid_tiling(rng: random.Random, shape) -> list:
    """An exact tiling: each dimension cut at random points."""
    cuts = [sorted({0, n, *rng.sample(range(1, n), rng.randint(0, n - 1))}) if n > 1 else [0, n] for n in shape]
    spans = [list(zip(c, c[1:])) for c in cuts]
    return [(tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*spans)]


def disturbed(rng: random.Random, shape, chunks) -> list:
    chunks = list(chunks)
    kind = rng.choice(["move", "grow", "shrink", "drop", "duplicate", "none", "swap"])
    i = rng.randrange(len(chunks))
    offsets, sizes = map(list, chunks[i])
    d = rng.randrange(len(shape))
    if kind == "move":
        offsets[d] += rng.choice([-1, 1])
    elif kind == "grow":
        sizes[d] += 1
    elif kind == "shrink":
        sizes[d] -= 1
    elif kind == "drop":
        del chunks[i]
        return chunks
    elif kind == "duplicate":
        return chunks + [chunks[i]]
    elif kind == "swap" and len(chunks) > 1:
        j = rng.randrange(len(chunks))
        chunks[i], chunks[j] = chunks[j], chunks[i]  # order never matters
        return chunks
    chunks[i] = (tuple(offsets), tuple(sizes))
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_exactly_the_exact_tilings_are_accepted(seed):
    rng = random.Random(seed)
    judged = {True: 0, False: 0}
    for _ in range(50):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        chunks = grid_tiling(rng, shape)
        for _ in range(rng.randint(0, 2)):
            chunks = disturbed(rng, shape, chunks) or chunks
        exact = brute_force_exact(shape, chunks)
        assert (tiling_problem(shape, chunks) is None) == exact, (shape, chunks)
        judged[exact] += 1
    assert judged[True] and judged[False]  # both kinds were drawn


def test_the_issue_cases():
    assert tiling_problem((4, 2), [((0, 0), (3, 2)), ((2, 0), (2, 2))]) == "the chunks at [0, 0] and [2, 0] overlap"
    assert "cover 6 of its 8" in tiling_problem((4, 2), [((0, 0), (3, 2))])
    assert tiling_problem((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]) is None
