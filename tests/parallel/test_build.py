"""One build path for every layout: each rank's part holds slices of the one-process model.

Each case spawns gloo ranks that build their part with parallel.build_model, describe every
parameter with parallel.naming, generate greedily with the LayoutDecoder and save a checkpoint
(train.checkpoint) of the untrained part. The tests put the pieces back together and compare them with
the one-process model built from the same seed: weights exactly, generated tokens exactly, and
the checkpoint read back whole (train.checkpoint.read_model_weights) exactly.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from model import GPTConfig, build, generate
from parallel.naming import Shard, full_shapes, layer_shards, load_full_, parameter_map, split_local_name

# vocab 300 is no multiple of 128·tp: at tp=4 the last rank's embedding rows are all padding.
CONFIG = GPTConfig(name="build-test", n_layer=4, n_head=4, d_model=32, seq_len=16, vocab_size=300,
                   attention_pattern="alternating", local_window=4)
SEED = 1234
LAYOUTS = {  # name: (tp, pp, sequence_parallel, world size, pipeline schedule)
    "tp2-pp2-sp": (2, 2, True, 4, "1f1b"),
    "tp4": (4, 1, False, 4, "1f1b"),
    "pp3": (1, 3, False, 3, "1f1b"),  # 2, 1 and 1 blocks
    # two chunks a rank in a V: rank 0 holds the embedding and the head, one tied Parameter; the decoder
    # walks 0 → 1 → 1 → 0, the turn of the V in memory
    "pp2-zbv": (1, 2, False, 2, "zb-v"),
}


def prompt() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))  # (2, 5)


def part_worker(tp: int, pp: int, sequence_parallel: bool, schedule: str, save_dir: str) -> dict:
    from parallel.build import BuildOptions, build_model
    from parallel.layout_decoder import LayoutDecoder
    from parallel.pipeline import StageSplit
    from parallel.schedules.orders import placement_of
    from parallel.topology import Topology
    from train.checkpoint import CheckpointParts, EngineCounters, ProcessRNG, Record, save
    from train.run.engine import create_engine

    topology = Topology.create(tp=tp, pp=pp)
    stages = StageSplit(placement_of(schedule, pp)) if pp > 1 else None
    part = build_model(CONFIG, topology, SEED, "cpu", BuildOptions(sequence_parallel=sequence_parallel, stages=stages))
    shards = parameter_map(part, CONFIG, topology)
    result = {
        "coords": (topology.pp_rank, topology.tp_rank),
        "params": {name: (shard, part.get_parameter(name).detach().clone()) for name, shard in shards.items()},
        # 20 tokens after 5: past the window (4) and past seq_len (16), where the context slides
        "tokens": generate(LayoutDecoder(part, CONFIG, topology), prompt(), 20, temperature=0),
        "mode changes": mode_changes(part),
    }
    ds_config = {"train_batch_size": topology.dp_size, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9}
    engine = create_engine(part, torch.optim.AdamW(part.parameters()), None, ds_config, mpu=None if pp > 1 else topology.mpu)
    parts = CheckpointParts()  # what every checkpoint holds: progress, DeepSpeed's step counters, the RNG
    parts.add("progress", Record({"step": 0, "tokens": 0}))
    parts.add("engine counters", EngineCounters(engine))
    parts.add("rng", ProcessRNG(), per_rank=True)
    save(engine, topology, CONFIG, save_dir, parts)
    return result


def mode_changes(part) -> dict[str, str]:
    """{module name.mode: what happened} when each of the part's modes is assigned its own value again
    (model/modes.py: a built layer's modes are fixed)."""
    from model.modes import Fixed

    outcomes = {}
    for name, module in part.named_modules():
        for attr, value in vars(type(module)).items():
            if isinstance(value, Fixed):
                try:
                    setattr(module, attr, getattr(module, attr))
                    outcomes[f"{name}.{attr}"] = "changed"
                except AttributeError as err:
                    outcomes[f"{name}.{attr}"] = str(err)
    return outcomes


@pytest.fixture(scope="module")
def reference() -> dict:
    model = build(CONFIG, "cpu", SEED).eval()
    return {"params": full_values(model), "tokens": generate(model, prompt(), 20, temperature=0)}


def full_values(model) -> dict[str, torch.Tensor]:
    """{name: full tensor} of a one-process model: the padded vocabulary cut to its full_shape (V, d)."""
    return {n: p.detach()[tuple(slice(0, k) for k in getattr(p, "full_shape", p.shape))]
            for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory) -> tuple[str, list[dict], object]:
    tp, pp, sp, world, schedule = LAYOUTS[request.param]
    save_dir = tmp_path_factory.mktemp(request.param)
    return request.param, run_distributed(part_worker, world, tp, pp, sp, schedule, str(save_dir)), save_dir


def test_every_parameter_is_a_slice_of_the_one_process_model(layout, reference):
    """Put back together from the naming map alone: every element of every full tensor comes from
    exactly one non-replica (tp rank 0 speaks for replicated ones), and equals the one-process value."""
    name, ranks, _ = layout
    full = {n: torch.full(p.shape, float("nan")) for n, p in reference["params"].items()}
    filled = {n: torch.zeros(p.shape, dtype=torch.int) for n, p in reference["params"].items()}
    for rank in ranks:
        _, tp_rank = rank["coords"]
        for local_name, (shard, tensor) in rank["params"].items():
            assert tuple(tensor.shape) == shard.local_shape, f"{name}: {local_name}"
            assert torch.equal(tensor[shard.local_index], reference["params"][shard.name][shard.index]), f"{name}: {local_name}"
            padding = tensor.clone()
            padding[shard.local_index] = 0
            assert not padding.any(), f"{name}: {local_name} has non-zero padding"
            if shard.tied or (shard.replicated and tp_rank != 0):
                continue
            full[shard.name][shard.index] = tensor[shard.local_index]
            filled[shard.name][shard.index] += 1
    for full_name, expected in reference["params"].items():
        assert (filled[full_name] == 1).all(), f"{name}: {full_name} covered {filled[full_name].unique().tolist()} times"
        assert torch.equal(full[full_name], expected), f"{name}: {full_name}"


def test_replicated_and_tied_parameters_are_marked(layout):
    name, ranks, _ = layout
    tp = LAYOUTS[name][0]
    for rank in ranks:
        for local_name, (shard, _) in rank["params"].items():
            _, within = split_local_name(local_name)
            replicated = within.startswith(("ln_", "wpe")) or within.endswith(("attn.proj.bias", "mlp.proj.bias"))
            assert shard.replicated == (replicated or tp == 1), f"{name}: {local_name}"
            assert shard.tied == (within == "lm_head.weight"), f"{name}: {local_name}"
            if shard.tied:
                assert shard.name == "layers.0.wte.weight"


def test_greedy_generation_at_every_layout_equals_one_process(layout, reference):
    name, ranks, _ = layout
    for rank in ranks:
        assert torch.equal(rank["tokens"], reference["tokens"]), f"{name}: rank {rank['coords']}"
    assert len(set(reference["tokens"][0, 5:].tolist())) > 3  # varied output: the check has teeth


def test_a_checkpoint_of_any_layout_reads_back_as_the_whole_model(layout, reference):
    from train.checkpoint import read_model_weights, tag_folder

    name, _, save_dir = layout
    weights = read_model_weights(tag_folder(save_dir), CONFIG)
    assert weights.keys() == reference["params"].keys()
    for full_name, expected in reference["params"].items():
        assert torch.equal(weights[full_name], expected), f"{name}: {full_name}"


def test_layer_shards_of_a_padded_vocabulary():
    """tp = 2 pads 300 rows to 512: rank 1 holds rows 256 … 299 of the full matrix, then 212 zero rows."""
    wte = layer_shards(CONFIG, 0, tp=2, tp_rank=1)["wte.weight"]
    assert wte == Shard("layers.0.wte.weight", (300, 32), 0, (slice(256, 300), slice(0, 32)),
                        (slice(0, 44), slice(0, 32)), (256, 32))
    last = layer_shards(CONFIG, 0, tp=4, tp_rank=3)["wte.weight"]  # rows 384 … 511 of the padded 512: padding only
    assert (last.index[0], last.local_index[0], last.local_shape) == (slice(300, 300), slice(0, 0), (128, 32))
    head = layer_shards(CONFIG, CONFIG.n_layer + 1, tp=2, tp_rank=0)
    assert head["lm_head.weight"].tied and head["lm_head.weight"].name == "layers.0.wte.weight"
    assert head["ln_f.weight"].replicated and not head["ln_f.weight"].tied


def test_row_and_column_parallel_slices():
    block = layer_shards(CONFIG, 2, tp=2, tp_rank=1)  # block 1
    assert block["attn.qkv.weight"].index == (slice(48, 96), slice(0, 32))  # output rows: heads 2 and 3
    assert block["attn.proj.weight"].index == (slice(0, 32), slice(16, 32))  # input columns
    assert block["attn.proj.bias"].replicated and block["mlp.fc.bias"].index == (slice(64, 128),)
    assert set(full_shapes(CONFIG)) == set(dict(build(CONFIG).named_parameters()))


def test_loading_full_weights_checks_names_and_shapes():
    model = build(CONFIG, "cpu", seed=1)
    weights = {n: p.clone() for n, p in full_values(build(CONFIG, "cpu", seed=2)).items()}
    from parallel.topology import Topology

    topology = Topology.create()
    load_full_(model, weights, CONFIG, topology)
    assert all(torch.equal(p, weights[n]) for n, p in full_values(model).items())
    with pytest.raises(ValueError, match=r"layers.2.mlp.fc.weight: given shape \(3, 3\), the model's is \(128, 32\)"):
        load_full_(model, {**weights, "layers.2.mlp.fc.weight": torch.zeros(3, 3)}, CONFIG, topology)
    with pytest.raises(KeyError, match="no tensor 'layers.0.wpe.weight'"):
        load_full_(model, {n: w for n, w in weights.items() if n != "layers.0.wpe.weight"}, CONFIG, topology)
    with pytest.raises(ValueError, match="is not a parameter of the layer list"):
        split_local_name("module.layers.x.weight")


def test_parallel_and_train_declare_no_model_layer():
    """The layers are model/'s: parallel/ and train/ hold only parallel building blocks (sharded
    linears and embeddings, the sequence-parallel LayerNorm), a whole-vocabulary view of a sharded
    GPT, DeepSpeed's pipeline container, and its pipeline engine running ZB-H1 (an nn.Module as
    every DeepSpeed engine is)."""
    import importlib
    import inspect
    from pathlib import Path

    from torch import nn

    declared = set()
    repo = Path(__file__).resolve().parents[2]
    for package in ("parallel", "train"):
        for path in sorted((repo / package).rglob("*.py")):
            module = importlib.import_module(".".join(path.relative_to(repo).with_suffix("").parts))
            declared |= {f"{module.__name__}.{name}" for name, cls in inspect.getmembers(module, inspect.isclass)
                         if issubclass(cls, nn.Module) and cls.__module__ == module.__name__}
    assert declared == {
        "parallel.tensor.ColumnParallelLinear", "parallel.tensor.RowParallelLinear", "parallel.tensor.VocabParallelEmbedding",
        "parallel.tensor.VocabParallelUnembedding", "parallel.tensor.SequenceParallelLayerNorm", "parallel.tensor.FullLogits",
        "parallel.pipeline.PipelineStages", "parallel.schedules.engine.ScheduleEngine",
    }


def test_parallel_reads_no_run_settings():
    """parallel/ knows topologies, shards and stages: no Hydra config, no train.*, optim.* or logging.* keys."""
    import re
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[2] / "parallel").glob("*.py")):
        source = path.read_text()
        assert not re.search(r"\b(cfg|omegaconf|hydra)\b|\.(train|optim|logging)\.", source, re.IGNORECASE), path.name


def test_a_built_layer_refuses_a_mode_change(layout):
    """Every mode of every layer (the Head's loss, a Block's recomputation, a column layer's overlap and
    sequence parallelism, a LayerNorm's gather, …) is fixed once built: assigning it raises, naming
    where the mode is chosen instead."""
    name, ranks, _ = layout
    kinds = {key.rpartition(".")[2] for rank in ranks for key in rank["mode changes"]}
    expected = {"selective_recomputation", "fused_loss"}
    if LAYOUTS[name][0] > 1:
        expected |= {"overlap", "sequence_parallel"}
    if LAYOUTS[name][2]:
        expected.add("gather_output")
    assert expected <= kinds, kinds
    for rank in ranks:
        for key, outcome in rank["mode changes"].items():
            assert "fixed when the layer is built" in outcome and "BuildOptions" in outcome, (key, outcome)
