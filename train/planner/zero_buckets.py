"""DeepSpeed's zero_optimization settings chosen from a plan, instead of DeepSpeed's defaults.

DeepSpeed reduces gradients (ZeRO 1, 2 and 3) and gathers parameters (ZeRO 3) in buckets. With
`overlap_comm` a bucket is reduced on a side stream as soon as it is full, while the backward goes
on; the first reduction can start only once a bucket's worth of gradients exists, and whatever the
last bucket holds is reduced after the backward ends. So a bucket should be small next to the
backward that fills it and large enough that each collective's fixed cost stays small: the plan
takes one transformer block's parameters on a rank, E = the block's elements / tp (GPT-3 175B at
tp = 8: 226M; 13B at tp = 2: 78.7M). Then:

  reduce_bucket_size            E: a block's gradients are reduced while the next block's backward
                                runs; at most one block's reduction is left after the backward
  allgather_bucket_size         E: ZeRO 1/2's all-gather of the updated partitions, in the same
                                pieces (after the step, not overlapped)
  contiguous_gradients          true: gradients copied into one buffer as they are reduced (no
                                fragmentation from many gradient tensors)
  overlap_comm                  Implementation.overlap_dp (parallel.overlap_communication)
  stage3_prefetch_bucket_size   E: the next block's parameters are gathered while this one computes
  stage3_param_persistence_threshold   the planner's PERSISTENCE_THRESHOLD (DeepSpeed's 1e5): the
                                vectors (biases, LayerNorm) stay gathered, as the plan counts them

E is capped at DeepSpeed's default reduce bucket (5e8 elements). The plan's memory counts the same
buckets (ZeRO 2's reduce bucket, ZeRO 3's buffers). ZeRO 0 returns only the stage.
"""

from __future__ import annotations

from train.planner.counts import PERSISTENCE_THRESHOLD, bucket_elements
from train.planner.estimate import Plan


def zero_optimization(plan: Plan) -> dict:
    """DeepSpeed's `zero_optimization` section for `plan`'s layout (module docstring)."""
    stage = plan.layout.zero_stage
    settings = {"stage": stage}
    if stage == 0:
        return settings
    bucket = bucket_elements(plan.model, plan.layout.tp)
    settings.update(overlap_comm=plan.implementation.overlap_dp, contiguous_gradients=True, reduce_bucket_size=bucket)
    if stage in (1, 2):
        settings["allgather_bucket_size"] = bucket
    else:
        settings.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=PERSISTENCE_THRESHOLD)
    return settings
