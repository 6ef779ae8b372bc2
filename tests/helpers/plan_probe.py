"""What a built rank really holds and sends: runs inside the gloo processes of tests/train/planner/test_plan_counts.py.

`probe(...)` builds this rank's model (parallel.build), optimizer and DeepSpeed engine (train.run.engine)
the way train/run/loop.py does, runs two optimizer steps of random tokens and reports, from the engine's
own objects at the second step (just before the optimizer updates):

  parameters  module parameters (unique)                 weights   their storages (ZeRO 1/2: the
  gradients   p.grad (ZeRO 0), the gradient partition              flat buffers; ZeRO 3: the
              buffers ZeRO hands to the optimizer                  partitions and the persistent
  master      ZeRO's fp32 partition copies                         full copies)
  moments     the inner optimizer's exp_avg, exp_avg_sq  buffers   ZeRO 3's reduce buckets

and the communication of that step: parallel/comm.py's record of tensor-parallel collectives, and
DeepSpeed's communication logger for everything DeepSpeed sends (pipeline and data parallel).
"""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf

from model import GPTConfig


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.device.type != "meta" and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state(engine, stage: int) -> dict:
    module_params = list(engine.module.parameters())
    zero = engine.optimizer if stage > 0 else None
    inner = zero.optimizer if zero is not None else engine.optimizer
    moments = [v for state in inner.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    if hasattr(zero, "bf16_groups_flat"):  # DeepSpeed's bf16 optimizer (bf16 at ZeRO ≤ 1): its bf16 gradients
        weights, grads = zero.bf16_groups_flat, zero.fp32_groups_gradients_flat  # are dropped as they are added
        master, buffers = zero.fp32_groups_flat_partition, []
    elif stage == 0:
        weights, grads, master, buffers = module_params, [p.grad for p in module_params], [], []
    elif stage in (1, 2):
        weights = zero.bit16_groups_flat
        grads = [t for group in zero.averaged_gradients.values() if group is not None for t in group]
        master, buffers = zero.single_partition_of_fp32_groups, []
    else:
        persistent = zero.parameter_offload.persistent_parameters
        weights = [p.ds_tensor for p in module_params] + [p.data for p in persistent]
        grads, master = [zero.grad_partitions_flat_buffer], zero.fp32_partitioned_groups_flat
        buffers = [bucket.buffer for bucket in zero.ipg_buckets.values()]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in module_params)
    return {
        "parameters": count, "weights": _storage_bytes(weights), "gradients": _storage_bytes(grads),
        "master": _storage_bytes(master), "moments": _storage_bytes(moments), "buffers": _storage_bytes(buffers),
    }


def probe(model: dict, tp: int, pp: int, zero_stages: list[int], global_batch: int, micro_batch: int,
          precision: str = "fp32") -> list[dict]:
    """For each ZeRO stage: this rank's coordinates, state bytes and one step's communication, under `precision`
    (fp32, or bf16: bf16 weights, DeepSpeed's bf16 optimizer at ZeRO ≤ 1)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.comm import comm as ds_comm

    from parallel.build import BuildOptions, build_model
    from parallel.comm import record_comm
    from parallel.topology import Topology
    from train.run import engine as engines
    from train.run.optimizer import GIVEN_NORM, TokenLR, make_optimizer, make_schedule
    from train.run.step import pipeline_inputs
    from train.runtime.process_group import init_distributed
    from train.runtime.resolve import Runtime

    init_distributed(torch.device("cpu"))
    runtime = Runtime(torch.device("cpu"), precision)
    topology = Topology.create(tp, pp)
    cfg_model = GPTConfig(**model)
    results = []
    for stage in zero_stages:
        cfg = OmegaConf.create({
            "train": {"seed": 1, "global_batch_size": global_batch, "micro_batch_size": micro_batch,
                      "precision": precision},
            "parallel": {"tp": tp, "pp": pp, "zero_stage": stage, "offload_optimizer": False,
                         "sequence_parallel": False, "activation_checkpointing": 0},
            "optim": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
                      "warmup_tokens": 10, "decay_tokens": 10_000, "min_lr_ratio": 0.1},
            "deepspeed": {"comms_logger": {"enabled": True, "prof_all": True, "verbose": False}},
        })
        options = BuildOptions(cfg.parallel.sequence_parallel, cfg.parallel.activation_checkpointing)
        model_obj = build_model(cfg_model, topology, cfg.train.seed, torch.device("cpu"), options)
        pipelined = pp > 1
        mpu = model_obj.mpu() if pipelined else topology.mpu
        optimizer = make_optimizer(model_obj, cfg.optim, 1e-3, clip=engines.clipping(cfg.parallel, runtime), mpu=mpu)
        scheduler = TokenLR(optimizer, make_schedule(cfg.optim, "probe", 64 * 10), 64)
        ds_config = engines.deepspeed_config(cfg.train, cfg.parallel, cfg.optim, OmegaConf.to_container(cfg.deepspeed),
                                              topology.dp_size, runtime)
        engine = engines.create_engine(model_obj, optimizer, scheduler, ds_config, mpu=None if pipelined else mpu)
        if engines.clipping(cfg.parallel, runtime) == GIVEN_NORM:  # as train/run/build.py
            engines.take_norm(optimizer, engine)
        captured = {}
        zero = engine.optimizer
        original_step = zero.step

        def step(*args, **kwargs):
            captured.update(_state(engine, stage))
            return original_step(*args, **kwargs)

        generator = torch.Generator().manual_seed(topology.dp_rank)
        micro_batches = global_batch // (micro_batch * topology.dp_size)
        tokens = torch.randint(0, cfg_model.vocab_size, (micro_batches, micro_batch, cfg_model.seq_len + 1), generator=generator)
        batches = [(w[:, :-1], w[:, 1:]) for w in tokens]

        def train_step():
            if pipelined:
                engine.train_batch(data_iter=pipeline_inputs(batches))
            else:
                for inputs, targets in batches:
                    engine.backward(engine(inputs, targets))
                    engine.step()

        train_step()  # the first step creates the optimizer state
        zero.step = step
        ds_comm.comms_logger.comms_dict.clear()
        with record_comm() as events:
            train_step()
        zero.step = original_step
        deepspeed_log = {op: {size: record[0] for size, record in sizes.items()}
                         for op, sizes in ds_comm.comms_logger.comms_dict.items()}
        results.append({
            "zero_stage": stage, "precision": precision, "coords": (topology.pp_rank, topology.dp_rank, topology.tp_rank),
            "state": captured, "tp_events": [(e.op, e.phase, e.nbytes) for e in events], "deepspeed": deepspeed_log,
        })
        del engine, model_obj, optimizer
    return results
