"""`parallel.*`: the layout (world size = tp · pp · dp, dp what remains), ZeRO and the recomputation and
communication options (docs/parallelism.md). What spans sections (tp dividing the heads, the world size,
the sequence length) is checked when the run is resolved (train/run/spec.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from parallel.schedules.orders import INTERLEAVED, ONE_F_ONE_B, SCHEDULES, SPLIT_BACKWARD, ZB_V
from train.config.settings import BOOLEAN, Check, ConfigError, Section, one_of, setting

MANUAL, AUTO = "manual", "auto"
# parallel.layout=auto chooses these keys at each start (train/planner/elastic.py); they may then not be set
AUTO_KEYS = (
    "parallel.tp", "parallel.pp", "parallel.zero_stage", "parallel.sequence_parallel",
    "parallel.activation_checkpointing", "parallel.offload_optimizer", "parallel.pipeline_schedule",
    "parallel.virtual_stages", "parallel.stage_layers", "train.micro_batch_size",
)
STAGE_LAYERS = Check(lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) > 0
                                             and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v)),
                     "must be null (balanced by count) or a list of positive block counts, one per virtual stage")
RECOMPUTATION = Check(lambda v: v == "selective" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                      "must be 0 (off), a positive block count or 'selective'")


@dataclass
class ParallelConfig(Section):
    """`parallel.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "parallel"
    layout: str = setting(
        MANUAL, "`manual`: the values below as given; `auto`: chosen for the world size and device of each start "
                "(fastest predicted that fits on GPUs; on a CPU the most data parallelism), keeping "
                "train.global_batch_size and the data order; it sets tp, pp, zero_stage, sequence_parallel, "
                "activation_checkpointing, offload_optimizer, pipeline_schedule, virtual_stages, stage_layers and "
                "train.micro_batch_size",
        one_of(MANUAL, AUTO, note=" (manual: the parallel.* settings as given; auto: chosen for the world size and device)"))
    tp: int = setting(1, "tensor parallel: heads, MLP columns and the vocabulary split over tp ranks")
    pp: int = setting(1, "pipeline parallel: blocks split into pp stages (DeepSpeed's pipeline engine)")
    zero_stage: int = setting(0, "DeepSpeed ZeRO over data-parallel ranks: 0–3 (at most 1 with pp > 1)",
                              one_of(0, 1, 2, 3))
    offload_optimizer: bool = setting(False, "ZeRO-Offload: optimizer state in CPU memory (needs zero_stage ≥ 1)",
                                      BOOLEAN)
    sequence_parallel: bool = setting(False, "with tp > 1: LayerNorm regions split along the sequence (combines with "
                                             "pp)", BOOLEAN)
    activation_checkpointing: Any = setting(
        0, "k > 0: recompute each run of k blocks in backward instead of storing activations; `selective`: recompute "
           "only LayerNorm and GELU outputs (no GEMM or collective repeated)", RECOMPUTATION)
    overlap_communication: bool = setting(True, "with tp > 1: each input-gradient all-reduce runs while the "
                                                "weight-gradient GEMM computes; under the interleaved schedule with "
                                                "bf16 or fp8 at ZeRO ≤ 1 (the optimizer not offloaded) and dp > 1: "
                                                "each chunk's data-parallel gradient reduction runs while the other "
                                                "chunks' backward passes do", BOOLEAN)
    tp_comm_overlap: bool = setting(
        False, "with tp > 1 and sequence_parallel: each block linear's all-gather and reduce-scatter run as tp − 1 ring "
               "exchanges, each behind a chunk of the layer's GEMM, forward and backward (parallel/overlap.py); with "
               "train.precision=fp8 the gathers travel in float8 (train.fp8_recipe=tensorwise only)", BOOLEAN)
    pipeline_schedule: str = setting(
        ONE_F_ONE_B, "with pp > 1: `1f1b` (DeepSpeed's schedule), `zb-h1` (zero-bubble: the blocks' weight-gradient "
                     "GEMMs deferred into the pipeline bubble, at 1F1B's activation memory), `interleaved` "
                     "(parallel.virtual_stages chunks a rank, Megatron-LM's order) or `zb-v` (two chunks a rank in a "
                     "V, weight gradients deferred; parallel/schedules/)", one_of(*SCHEDULES))
    virtual_stages: int = setting(
        1, "with pipeline_schedule=interleaved: V, the chunks of consecutive blocks each pipeline rank holds (the "
           "bubble shrinks about V-fold; micro batches a step a multiple of pp); 1 is 1F1B",
        Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "must be an integer ≥ 1"))
    stage_layers: Any = setting(
        None, "with pp > 1: the blocks of each virtual stage, first to last (pp·V counts, pp·2 for zb-v, summing to "
              "model.n_layer); null: balanced by count", STAGE_LAYERS)

    def check(self) -> None:
        zero, pp = self.zero_stage, self.pp
        if isinstance(pp, int) and pp > 1 and zero > 1:
            raise ConfigError(
                f"parallel.zero_stage={zero} with parallel.pp={pp}: DeepSpeed's pipeline engine shards at most the "
                f"optimizer state; use zero_stage 0 or 1 with pp > 1, or pp=1 for ZeRO-{zero}")
        if self.pipeline_schedule != ONE_F_ONE_B and self.layout == MANUAL and pp == 1:
            raise ConfigError(f"parallel.pipeline_schedule={self.pipeline_schedule} schedules pipeline stages: it needs "
                              "parallel.pp > 1 (with pp=1 use the default, 1f1b)")
        if self.virtual_stages > 1 and self.pipeline_schedule != INTERLEAVED:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages} with parallel.pipeline_schedule="
                              f"{self.pipeline_schedule}: chunks a rank are the interleaved schedule's (zb-v always "
                              "holds 2); set pipeline_schedule=interleaved or virtual_stages=1")
        if self.stage_layers is not None and isinstance(pp, int):
            stages = self.virtual_stage_count
            if len(self.stage_layers) != stages:
                raise ConfigError(f"parallel.stage_layers={list(self.stage_layers)}: {len(self.stage_layers)} counts for "
                                  f"{stages} virtual stages (pp={pp} × {stages // pp} chunks a rank); give one per stage")
        if self.tp_comm_overlap and not self.sequence_parallel and self.layout == MANUAL:
            raise ConfigError("parallel.tp_comm_overlap=true decomposes sequence parallelism's all-gathers and "
                              "reduce-scatters: it needs parallel.sequence_parallel=true")
        if self.offload_optimizer and zero == 0:
            raise ConfigError("parallel.offload_optimizer=true needs parallel.zero_stage ≥ 1 (ZeRO-Offload moves "
                              "ZeRO's optimizer shards)")

    @property
    def virtual_stage_count(self) -> int:
        """P: the virtual pipeline stages (pp · chunks a rank)."""
        return self.pp * (2 if self.pipeline_schedule == ZB_V else self.virtual_stages)

    @property
    def defers_weight_grads(self) -> bool:
        """The blocks' linears defer their weight gradients: a pipeline under a schedule that splits W off."""
        return isinstance(self.pp, int) and self.pp > 1 and self.pipeline_schedule in SPLIT_BACKWARD
