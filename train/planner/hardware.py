"""Hardware the planner predicts for: named presets (configs/plan/hardware/NAME.yaml, each figure
with its source) with any figure overridden from `plan.device.*`, or the GPU this process sees.

Bandwidths are per GPU and per direction: `nvlink_gbps` inside a node (NVLink through NVSwitch),
`internode_gbps` to other nodes (each GPU's own network adapter). The three efficiencies turn
datasheet rates into achieved ones (see README, "How the step time is modelled").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import yaml

from train.config.entry import CONFIG_DIR

PRESET_DIR = CONFIG_DIR / "plan" / "hardware"


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its node, with the achieved share of each datasheet rate."""

    name: str
    peak_tflops: float
    memory_gib: float
    hbm_tbps: float
    nvlink_gbps: float
    internode_gbps: float
    gemm_efficiency: float
    hbm_efficiency: float
    link_efficiency: float
    multiprocessors: int  # streaming multiprocessors: a kernel's tiles run on these in waves (kernel_costs.py)
    sources: dict = dataclasses.field(default_factory=dict, compare=False)
    preset: str = ""  # the preset it is (configs/plan/hardware/PRESET.yaml): its float8 table's name (fp8_rule.py)

    @property
    def flops(self) -> float:
        """Achieved GEMM FLOP/s."""
        return self.peak_tflops * 1e12 * self.gemm_efficiency

    @property
    def memory_bandwidth(self) -> float:
        """Achieved bytes/s of a memory-bound kernel (reads plus writes)."""
        return self.hbm_tbps * 1e12 * self.hbm_efficiency

    def link_bandwidth(self, inter_node: bool) -> float:
        """Achieved bytes/s a GPU sends in a collective."""
        return (self.internode_gbps if inter_node else self.nvlink_gbps) * 1e9 * self.link_efficiency

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FIGURES = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "sources", "preset")]


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def preset(name: str, overrides: dict | None = None) -> Hardware:
    """The preset `name` with the non-null `overrides` (figure → value) laid over it."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"plan.hardware={name!r} is not a preset; presets: {preset_names()}")
    values = yaml.safe_load(path.read_text())
    for key, value in (overrides or {}).items():
        if key not in FIGURES:
            raise ValueError(f"plan.device.{key} is not a hardware figure; figures: {FIGURES}")
        if value is not None:
            values[key] = value
            values.setdefault("sources", {})[key] = "overridden on the command line"
    for key in FIGURES:
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"hardware {name!r}: {key}={value!r} must be a positive number")
        if key.endswith("efficiency") and value > 1:
            raise ValueError(f"hardware {name!r}: {key}={value!r} must be at most 1")
    return Hardware(**{k: values[k] for k in ("name", *FIGURES)}, sources=values.get("sources", {}), preset=name)


# Device-name fragments → preset, most specific first (torch.cuda.get_device_name).
_BY_DEVICE_NAME = [("H200", "h200"), ("H100", "h100-80g"), ("A100", None)]


def preset_for_cuda_device(index: int = 0) -> str:
    """The name of the preset closest to the visible GPU (an unknown GPU: the H100's)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    name = next((preset for fragment, preset in _BY_DEVICE_NAME if fragment in props.name), "h100-80g")
    if name is None:  # A100: two memory sizes
        name = "a100-40g" if props.total_memory / 2**30 < 60 else "a100-80g"
    return name


def for_cuda_device(index: int = 0) -> Hardware:
    """The preset closest to the visible GPU, with its memory as CUDA reports it. An unknown GPU
    takes the H100 preset's rates (the pre-flight check needs only the memory to be right)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    name = preset_for_cuda_device(index)
    return dataclasses.replace(preset(name), name=f"{props.name} ({name} rates)", memory_gib=props.total_memory / 2**30)
