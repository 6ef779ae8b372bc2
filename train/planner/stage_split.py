"""The planner's split of the blocks over the virtual pipeline stages, counting the embedding on the first and
the head and loss on the last (parallel.stage_layers: the split a run takes; null, balanced by count).

Every rank is timed as the slowest one (train/planner/pipeline_time.py), so a split pays when it lowers
the largest rank total: with t the compute of one block and e_v what virtual stage v runs besides its
blocks (the embedding's lookup on stage 0; the final LayerNorm, unembedding and loss on the last),

    rank r's micro batch = Σ over its virtual stages v of (blocks_v · t + e_v)

Starting from the split by count, `balanced_blocks` moves one block at a time from a stage of the slowest
rank to a stage of the fastest while that lowers the slowest rank's total; each stage keeps one block at
least. A block is the unit: at GPT-3 175B on 16 ranks the head weighs a third of a block and no move
helps; at a smaller model, whose head is a few blocks' worth, the last rank gives blocks away.
"""

from __future__ import annotations

from train.planner.counts import stage_blocks
from train.planner.results import Plan


def balanced_blocks(plan: Plan) -> tuple[int, ...] | None:
    """The blocks of each virtual stage that lower `plan`'s slowest rank's compute, from its own per-stage
    figures (Plan.stage_seconds); None when the plan's split cannot be bettered so."""
    layout, n_layer = plan.layout, plan.model.n_layer
    placement = layout.placement
    if layout.pp == 1:
        return None
    blocks = [len(stage_blocks(n_layer, placement.stages, v, layout.stage_layers)) for v in range(placement.stages)]
    per_block = min(t / b for t, b in zip(plan.stage_seconds, blocks))  # a stage with nothing else: blocks only
    extra = [t - b * per_block for t, b in zip(plan.stage_seconds, blocks)]
    given = list(blocks)

    def totals() -> list[float]:
        return [sum(blocks[v] * per_block + extra[v] for v in placement.stages_of(r)) for r in range(layout.pp)]

    while True:
        ranks = totals()
        slowest, fastest = ranks.index(max(ranks)), ranks.index(min(ranks))
        source = max(placement.stages_of(slowest), key=lambda v: blocks[v])
        target = min(placement.stages_of(fastest), key=lambda v: blocks[v])
        if blocks[source] == 1 or slowest == fastest:
            break
        blocks[source] -= 1
        blocks[target] += 1
        if max(totals()) >= max(ranks) - 1e-12:
            blocks[source] += 1
            blocks[target] -= 1
            break
    return tuple(blocks) if blocks != given else None
