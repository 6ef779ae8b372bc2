"""Each chunk's data-parallel gradient reduction issued after its last B (parallel/schedules/grad_reduction.py) gives
DeepSpeed's own reduction at the step's end bit for bit, and runs while the other chunks' backward passes do.

4 gloo ranks: pp = 2 × dp = 2, the interleaved schedule with 2 chunks a rank, bf16 (DeepSpeed's bf16 optimizer, as
on a GPU), two steps each way from the same weights and data. Every rank's bf16 weights and fp32 master weights
after the second step equal those of the same run reduced all at once; the recorded order shows, each step, an
issue for each chunk, a B of the rank's other chunk after the first issue, and every wait before the optimizer's
step; the reduction at the step's end then takes the tied embedding's gradient alone (a gradient reduced twice would
leave the weights as they are at dp = 2, where the mean of two equal values is that value: counted instead).
"""

from __future__ import annotations

import torch
from distributed import run_distributed

CFG = dict(name="chunk-reduction", n_layer=4, n_head=2, d_model=32, seq_len=16, vocab_size=128, attention_impl="torch")
PP, VIRTUAL, MICRO_BATCHES, MICRO_BATCH = 2, 2, 4, 1


def _train(reduce_chunks: bool) -> tuple[list[torch.Tensor], list[tuple[str, str]], bool, int, int]:
    """(this rank's parameters and fp32 masters after two steps, the recorded order of the second, whether the
    engine reduced chunk by chunk, the gradient elements the second step's ReduceGrads handed DeepSpeed's reduction,
    this rank's tied embedding's elements)."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    from model import GPTConfig
    from parallel.build import BuildOptions, build_model
    from parallel.comm import record_overlap
    from parallel.pipeline import StageSplit
    from parallel.schedules.engine import ScheduleEngine
    from parallel.schedules.orders import placement_of
    from parallel.schedules.program import InputGradPass
    from parallel.topology import Topology
    from train.config.sections import ParallelConfig, TrainConfig
    from train.config.sections.optim import OptimConfig
    from train.run.engine import clipping, create_engine, deepspeed_config, take_norm
    from train.run.optimizer import make_optimizer
    from train.run.step import micro_batch_split, pipeline_inputs
    from train.runtime.resolve import Runtime

    config, runtime = GPTConfig(**CFG), Runtime(torch.device("cpu"), "bf16")
    topology = Topology.create(tp=1, pp=PP)
    torch.manual_seed(0)
    model = build_model(config, topology, 0, torch.device("cpu"),
                        BuildOptions(stages=StageSplit(placement_of("interleaved", PP, VIRTUAL))))
    dp = topology.dp_size
    train = TrainConfig(global_batch_size=MICRO_BATCHES * MICRO_BATCH * dp, micro_batch_size=MICRO_BATCH,
                        precision="bf16", device="cpu")
    parallel = ParallelConfig(pp=PP, pipeline_schedule="interleaved", virtual_stages=VIRTUAL, zero_stage=1)
    optimizer = make_optimizer(model, OptimConfig(), 1e-3, clip=clipping(parallel, runtime), mpu=model.mpu())
    engine = create_engine(model, optimizer, None, deepspeed_config(train, parallel, OptimConfig(), {}, dp, runtime))
    engine = ScheduleEngine.adopt(engine, "interleaved", VIRTUAL, reduce_chunks=reduce_chunks)
    take_norm(optimizer, engine)
    generator = torch.Generator().manual_seed(topology.dp_rank)
    windows = torch.randint(0, config.vocab_size, (2, MICRO_BATCHES * MICRO_BATCH, config.seq_len + 1), generator=generator)
    engine.train_batch(data_iter=pipeline_inputs(micro_batch_split(windows[0], MICRO_BATCH)))

    runs = {kind: ScheduleEngine._INSTRUCTIONS.get(kind) or ScheduleEngine._INSTRUCTION_MAP[kind]
            for kind in (InputGradPass, OptimizerStep)}
    at_end = []  # elements of the gradients each call of DeepSpeed's reduction takes
    reduce_rest = engine.buffered_allreduce_fallback

    def counted(grads=None, **kwargs):
        held = grads if grads is not None else engine.optimizer.get_grads_for_reduction()[0]
        at_end.append(sum(g.numel() for g in held))
        return reduce_rest(grads=grads, **kwargs)

    engine.buffered_allreduce_fallback = counted
    with record_overlap() as order:
        def backward(self, buffer_id, stage):
            order.append(("B", str(stage)))  # as it starts: a chunk's reduction is issued at the end of its last
            runs[InputGradPass](self, buffer_id=buffer_id, stage=stage)

        def step(self, **kwargs):
            order.append(("optimizer step", ""))
            return runs[OptimizerStep](self, **kwargs)

        ScheduleEngine._INSTRUCTIONS[InputGradPass], ScheduleEngine._INSTRUCTIONS[OptimizerStep] = backward, step
        try:
            engine.train_batch(data_iter=pipeline_inputs(micro_batch_split(windows[1], MICRO_BATCH)))
        finally:
            ScheduleEngine._INSTRUCTIONS[InputGradPass] = runs[InputGradPass]
            del ScheduleEngine._INSTRUCTIONS[OptimizerStep]
    state = [p.detach().clone() for p in model.parameters()]
    state += [t.detach().clone() for t in engine.optimizer.fp32_groups_flat_partition]
    tied = sum(weight.numel() for weight, _ in model.get_tied_weights_and_groups())
    return state, order, engine.chunk_reductions is not None, sum(at_end), tied


def _both_ways() -> dict:
    return {reduce_chunks: _train(reduce_chunks) for reduce_chunks in (False, True)}


def test_chunk_reductions_equal_deepspeeds_and_overlap_the_backward():
    ranks = run_distributed(_both_ways, PP * 2, timeout=600)
    for rank, runs in enumerate(ranks):
        (plain, plain_order, plain_chunked, plain_end, tied), (chunked, order, was_chunked, at_end, _) = runs[False], runs[True]
        assert not plain_chunked and was_chunked, rank
        assert at_end == tied > 0 and plain_end > 5 * tied, (rank, at_end, tied, plain_end)  # all of them, without
        assert not any(step == "issue" for step, _ in plain_order)
        for a, b in zip(plain, chunked, strict=True):
            assert torch.equal(a, b), f"rank {rank}: a weight differs from DeepSpeed's reduction at the step's end"
        own = {tag for step, tag in order if step == "B"}  # this rank's virtual stages
        issues = [tag.split()[-1] for step, tag in order if step == "issue"]
        assert sorted(issues) == sorted(own), (rank, order)  # every chunk reduced early, once
        first_issue = next(i for i, (step, _) in enumerate(order) if step == "issue")
        later = [tag for step, tag in order[first_issue:] if step == "B"]
        assert later and issues[0] not in later, (rank, order)  # the other chunk's backward runs beside it
        step_at = order.index(("optimizer step", ""))
        waits = [i for i, (step, _) in enumerate(order) if step == "wait"]
        assert len(waits) == len(issues) and max(waits) < step_at, (rank, order)
