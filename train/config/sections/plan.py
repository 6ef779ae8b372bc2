"""`plan.*`: the planner (`python -m train.plan`, and `+plan=default` in a run): memory, FLOPs,
communication and step time of a layout, predicted from the config alone (docs/planner.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from train.config.settings import BOOLEAN, POSITIVE_INT, Check, Section, number, one_of, setting

FORMATS = ("table", "json")


@dataclass
class DeviceFigures(Section):
    """`plan.device.*`: a hardware preset's figures overridden (null: the preset's)."""

    PREFIX: ClassVar[str] = "plan.device"
    peak_tflops: Any = setting(None, "dense bf16 TFLOP/s per GPU")
    memory_gib: Any = setting(None, "device memory")
    hbm_tbps: Any = setting(None, "memory bandwidth, TB/s")
    nvlink_gbps: Any = setting(None, "intra-node bandwidth per GPU and direction, GB/s")
    internode_gbps: Any = setting(None, "inter-node bandwidth per GPU and direction, GB/s")
    gemm_efficiency: Any = setting(None, "share of peak a large GEMM reaches")
    hbm_efficiency: Any = setting(None, "share of memory bandwidth a large copy reaches")
    link_efficiency: Any = setting(None, "share of link bandwidth a collective reaches")
    multiprocessors: Any = setting(None, "streaming multiprocessors per GPU")


@dataclass
class PlanConfig(Section):
    """`plan.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "plan"
    gpus: Optional[int] = setting(None, "world size; null: the launch's WORLD_SIZE, else tp·pp (dp = 1)",
                                  Check(lambda v: v is None or POSITIVE_INT(v), "must be a positive integer"))
    gpus_per_node: int = setting(8, "ranks per node: tensor-parallel groups up to this size stay on NVLink", POSITIVE_INT)
    hardware: str = setting("h100-80g", "a preset in configs/plan/hardware/: a100-40g, a100-80g, h100-80g, h200")
    device: DeviceFigures = setting(doc="a preset's figures overridden, e.g. plan.device.memory_gib=40",
                                    factory=DeviceFigures)
    tokens: Any = setting(300_000_000_000, "tokens to train, for the days estimate (GPT-3: 300B)",
                          number(0, text="a non-negative number"))
    search: bool = setting(False, "rank every valid layout on plan.gpus by predicted throughput (the micro batch "
                                  "chosen too)", BOOLEAN)
    top: int = setting(10, "layouts the search prints", POSITIVE_INT)
    format: str = setting("table", "`table` or `json`", one_of(*FORMATS))
    dry_run: bool = setting(False, "build every distinct rank's shard on meta and check they cover the model", BOOLEAN)
    reserved_gib: Any = setting(2, "device memory the CUDA context, NCCL and allocator take before any tensor",
                                number(0, text="a non-negative number"))
