"""What a pipeline rank holds at its peak, by schedule: the planner against the bytes the rank keeps alive.

The planner (train/planner/estimate.py: `RankPlan.held`) says what each rank holds at the instant of its
order that holds the most: the saved activations of the (chunk) micro batches in flight, the inputs and
outputs the engine keeps for them, and the inputs and output gradients the deferred W passes keep. The
measurement runs the real engine (DeepSpeed's 1F1B, gpt3d's ScheduleEngine for the others; zb-v ordered by
the plan's pass shares, as on CUDA) on gloo ranks and watches every tensor an operation saves for its
backward (torch.autograd.graph.saved_tensors_hooks), every tensor the engine's input and output buffers hold
(and, once it lets go of them, any a live graph still holds) and every tensor the WeightGradStore keeps: at
each save and after each pipeline instruction, the distinct storages alive among them, parameters left out,
are what the rank holds; the step's largest is its peak. The two agree within a few bytes (the losses'
scalars) on every rank, for 1F1B, ZB-H1, the interleaved schedule (V = 2) and ZB-V, at tp = 1, at tp = 2 with
sequence parallelism and the fused loss, and at tp = 2 with DeepSpeed's activations sent in tp pieces.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from distributed import run_distributed

from model import GPTConfig
from train.planner.estimate import build_plan
from train.planner.hardware import preset
from train.planner.layout import Layout, for_precision

CFG = dict(name="pipeline-memory", n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=256,
           attention_impl="torch")
PP, MICRO_BATCHES, MICRO_BATCH = 2, 4, 2
SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 1)]  # parallel.virtual_stages (zb-v: 2 chunks)
SLACK_BYTES = 64  # a few bytes: the planner counts every tensor but the losses' scalars


class HeldBytes:
    """The live bytes of the tensors saved for backward and of those a WeightGradStore keeps, at their peak."""

    def __init__(self, parameters, store, pipe_buffers: dict):
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self._store, self._pipe_buffers = store, pipe_buffers
        self._saved: list[weakref.ref] = []
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in self._parameters:
            self._saved.append(weakref.ref(tensor))
            self.sample()
        return tensor

    def sample(self) -> None:
        self._saved = [ref for ref in self._saved if ref() is not None]
        live = [ref() for ref in self._saved]
        for kind in ("inputs", "outputs"):  # what the engine keeps of each micro batch in flight
            for held in self._pipe_buffers[kind]:
                live += [held] if isinstance(held, torch.Tensor) else list(held or ())
        # the inputs also once the engine lets go of them: a graph still alive holds them (autograd's leaves)
        watched = {id(ref()) for ref in self._saved}
        self._saved += [weakref.ref(t) for t in live if id(t) not in watched]
        if self._store is not None:
            live += [t for batch in [self._store._open, *self._store._sealed] for _, _, args in batch
                     for t in args if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
        self.peak = max(self.peak, sum(size for ptr, size in storages.items() if ptr not in self._parameters))

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)


def _rank_peaks(cfg_dict: dict, tp: int, sequence_parallel: bool, fused_loss: bool) -> dict:
    """(this rank's pipeline rank, {schedule: its peak held bytes in its second train_batch}) (the first
    train_batch exchanges the shapes)."""
    import deepspeed.runtime.pipe.engine as ds_engine

    from model.weight_grads import WeightGradStore
    from parallel.build import BuildOptions, build_model
    from parallel.pipeline import StageSplit
    from parallel.schedules.engine import ScheduleEngine
    from parallel.schedules.orders import SPLIT_BACKWARD, Costs, placement_of
    from parallel.topology import Topology
    from train.config.sections import ParallelConfig, TrainConfig
    from train.config.sections.optim import OptimConfig
    from train.run.engine import clipping, create_engine, deepspeed_config
    from train.run.optimizer import make_optimizer
    from train.run.step import micro_batch_split, pipeline_inputs
    from train.runtime.resolve import Runtime

    config, device, fp32 = GPTConfig(**cfg_dict), torch.device("cpu"), Runtime(torch.device("cpu"), "fp32")
    topology = Topology.create(tp=tp, pp=PP)
    windows = torch.randint(0, config.vocab_size, (MICRO_BATCHES * MICRO_BATCH, config.seq_len + 1),
                            generator=torch.Generator().manual_seed(0))
    batches = micro_batch_split(windows, MICRO_BATCH)
    peaks = {}
    for schedule, virtual in SCHEDULES:
        store = WeightGradStore() if schedule in SPLIT_BACKWARD else None
        split = StageSplit(placement_of(schedule, PP, virtual))
        model = build_model(config, topology, 0, device, BuildOptions(sequence_parallel=sequence_parallel, fused_loss=fused_loss,
                                                                      weight_grads=store, stages=split))
        train = TrainConfig(global_batch_size=MICRO_BATCHES * MICRO_BATCH, micro_batch_size=MICRO_BATCH,
                            precision="fp32", device="cpu")
        parallel = ParallelConfig(tp=tp, pp=PP, sequence_parallel=sequence_parallel, pipeline_schedule=schedule,
                                  virtual_stages=virtual)
        optimizer = make_optimizer(model, OptimConfig(), 1e-4, clip=clipping(parallel, fp32), mpu=model.mpu())
        engine = create_engine(model, optimizer, None, deepspeed_config(train, parallel, OptimConfig(), {}, 1, fp32))
        if schedule != "1f1b":  # zb-v orders its passes by the plan's shares, as on CUDA (RunSpec.pass_costs)
            costs = _plan(tp, sequence_parallel, fused_loss, schedule, virtual).pipeline.passes.shares()
            engine = ScheduleEngine.adopt(engine, schedule, virtual, store, Costs(*costs) if schedule == "zb-v" else Costs())
        engine.train_batch(data_iter=pipeline_inputs(batches))
        held = HeldBytes(model.parameters(), store, engine.pipe_buffers)
        tables = (ScheduleEngine._INSTRUCTIONS, ds_engine.PipelineEngine._INSTRUCTION_MAP)
        plain = [dict(table) for table in tables]

        def sampled(run):
            def instruction(self, **kwargs):
                out = run(self, **kwargs)
                held.sample()
                return out
            return instruction

        for table, runs in zip(tables, plain):
            table.update({kind: sampled(run) for kind, run in runs.items()})
        try:
            with held.hooks():
                engine.train_batch(data_iter=pipeline_inputs(batches))
        finally:
            for table, runs in zip(tables, plain):
                table.update(runs)
        peaks[schedule] = held.peak
    return topology.pp_rank, peaks


# (tp, sequence parallelism, fused loss): the activation received whole, in its sequence part, or in tp pieces
# gathered whole (DeepSpeed's pipe partitioning); the plain loss's and the fused loss's saved tensors
CASES = {"tp1": (1, False, False), "tp2-sp-fused": (2, True, True), "tp2-pieces": (2, False, False)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> tuple[tuple, list[dict]]:
    """(the case, {pipeline rank: its measured peaks}: every rank of a tp group holds the same)."""
    tp, sequence_parallel, fused_loss = CASES[request.param]
    by_rank = run_distributed(_rank_peaks, tp * PP, CFG, tp, sequence_parallel, fused_loss)
    assert len({str(peaks) for stage, peaks in by_rank if stage == 0}) == 1, by_rank
    return CASES[request.param], dict(by_rank)


def _plan(tp: int, sequence_parallel: bool, fused_loss: bool, schedule: str, virtual: int):
    layout = Layout(tp, PP, 1, MICRO_BATCHES * MICRO_BATCH, MICRO_BATCH, sequence_parallel=sequence_parallel,
                    schedule=schedule, virtual_stages=virtual)
    implementation = for_precision("fp32", fused_loss=fused_loss)
    return build_plan(GPTConfig(**CFG), layout, preset("h100-80g"), implementation=implementation)


@pytest.mark.parametrize("schedule,virtual", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_each_ranks_peak_holds_what_the_planner_says(case, schedule, virtual):
    (tp, sequence_parallel, fused_loss), measured = case
    for rank in _plan(tp, sequence_parallel, fused_loss, schedule, virtual).ranks:
        activations, copies, deferred = rank.held
        predicted, got = activations + copies + deferred, measured[rank.stage][schedule]
        assert abs(predicted - got) <= SLACK_BYTES, (schedule, rank.stage, rank.held, got)
