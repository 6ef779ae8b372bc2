"""parallel.build_model on the meta device: the real part's structure, and nothing else.

Four gloo ranks build their part of three layouts (tp=2 × pp=2 with sequence parallelism, tp=2 and
one-process-like tp=1, both data-parallel) twice: on "meta" and on "cpu". The meta part must have
exactly the CPU part's parameter names, shapes, dtypes, ties, sharding attributes and modules; and
a torch dispatch mode that sees every tensor operation must see none that makes a tensor off the
meta device while the meta part is built (nothing allocated, nothing initialised), where the CPU
build draws the initial weights (the recorder has teeth).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from model import GPTConfig
from distributed import run_distributed

CONFIG = GPTConfig(name="meta-test", n_layer=3, n_head=4, d_model=32, seq_len=16, vocab_size=300)
LAYOUTS = [(2, 2, True), (2, 1, False), (1, 1, False)]  # (tp, pp, sequence_parallel) in a world of 4
EACH_LAYOUT = pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=[f"tp{t}-pp{p}{'-sp' * s}" for t, p, s in LAYOUTS])


class OffMetaTensors(TorchDispatchMode):
    """Records every operation that returns a tensor outside the meta device: (op, shape)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self.made.append((str(func), tuple(leaf.shape)))
        return out


def describe(part: torch.nn.Module) -> dict:
    """Everything about a part's structure that does not depend on values."""
    params = dict(part.named_parameters(remove_duplicate=False))
    return {
        "kind": type(part).__name__,
        "params": [
            (name, tuple(p.shape), p.dtype, {k: repr(getattr(v, "keywords", v)) for k, v in vars(p).items()})
            for name, p in params.items()
        ],
        "ties": sorted(sorted(n for n in params if params[n] is p) for p in {id(p): p for p in params.values()}.values()),
        "modules": [(name, type(m).__name__) for name, m in part.named_modules()],
        "devices": sorted({t.device.type for t in [*params.values(), *part.buffers()]}),
        "modes": sorted((name, key, value) for name, m in part.named_modules()
                        for key, value in vars(m).items() if key.startswith("_fixed_")),
    }


def meta_worker(layouts) -> list[dict]:
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology

    results = []
    for tp, pp, sequence_parallel in layouts:
        topology = Topology.create(tp, pp)
        options = BuildOptions(sequence_parallel=sequence_parallel)
        with OffMetaTensors() as on_meta:
            meta = build_model(CONFIG, topology, 1234, "meta", options)
        with OffMetaTensors() as on_cpu:
            real = build_model(CONFIG, topology, 1234, "cpu", options)
        results.append({"meta": describe(meta), "cpu": describe(real), "made_on_meta": on_meta.made,
                        "made_on_cpu": on_cpu.made})
    return results


def half_built_worker() -> str:
    """A pipeline stage with one of its layers allocated and the others still on meta."""
    from model.gpt import layer_list
    from model.init import materialize_
    from parallel.pipeline import PipelineStages, stage_bounds
    from parallel.topology import Topology

    topology = Topology.create(1, 2)
    with torch.device("meta"):
        layers = layer_list(CONFIG)
    materialize_(layers[stage_bounds(CONFIG.n_layer, 2)[topology.pp_rank]], "cpu")
    with pytest.raises(ValueError) as raised:
        PipelineStages(layers, topology, None)
    return str(raised.value)


@pytest.fixture(scope="module")
def builds() -> list[list[dict]]:
    return run_distributed(meta_worker, 4, LAYOUTS)


@EACH_LAYOUT
def test_a_meta_build_has_exactly_the_structure_of_a_real_one(builds, layout):
    tp, pp, _ = LAYOUTS[layout]
    for rank, per_layout in enumerate(builds):
        meta, cpu = per_layout[layout]["meta"], per_layout[layout]["cpu"]
        assert meta["kind"] == cpu["kind"] == ("PipelineStages" if pp > 1 else "GPT"), f"rank {rank}"
        for key in ("params", "ties", "modules", "modes"):
            assert meta[key] == cpu[key], f"rank {rank}: {key}"
        assert meta["devices"] == ["meta"] and cpu["devices"] == ["cpu"], f"rank {rank}"
        if tp > 1:  # the check compares sharded parts: some parameter carries a sharding hint
            assert any("shard_of" in attrs for *_, attrs in meta["params"]), f"rank {rank}"


@EACH_LAYOUT
def test_a_meta_build_allocates_and_initialises_nothing(builds, layout):
    for rank, per_layout in enumerate(builds):
        assert per_layout[layout]["made_on_meta"] == [], f"rank {rank}"
        drawn = [op for op, _ in per_layout[layout]["made_on_cpu"] if "randn" in op]
        assert drawn, f"rank {rank}: the recorder saw no initial weights drawn in the CPU build"


def test_a_half_built_stage_is_refused():
    messages = run_distributed(half_built_worker, 2)
    assert all("partly on the meta device" in m for m in messages), messages
