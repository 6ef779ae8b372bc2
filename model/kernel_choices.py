"""Autotuned kernel choices, recorded and pinned: a resumed process runs the kernels its run tuned.

Triton's autotuner benchmarks a kernel's candidate configs the first time it sees a key (for the
attention kernels: the bucket of T, the band width, the head dim and the tensors' dtypes) and keeps
the fastest in `autotuner.cache[key]`, for this process only. Another process, a resumed run,
benchmarks again, and timing noise may pick another config: other block sizes sum in another order,
so its gradients are not the bits the first process would have computed, deterministic attention
included. A run therefore records every rank's choices in its checkpoints
(`recorded`: {kernel: [[key, config], …]}, JSON) and a resumed process puts them back
(`pin`) before its first step: the autotuner finds each recorded key in its cache and runs that
config without benchmarking. Keys it has not seen are tuned as usual.

A kernel with one candidate (autotuning off, GPT3D_TRITON_AUTOTUNE=0; or the Triton interpreter's
fixed small blocks) has nothing to choose and nothing to record.
"""

from __future__ import annotations


def recorded(autotuners: dict) -> dict[str, list]:
    """{kernel name: [[key, config], …]} of what each of `autotuners` ({name: triton Autotuner}) has chosen."""
    return {name: [[list(key), _config_record(config)] for key, config in tuner.cache.items()]
            for name, tuner in autotuners.items() if tuner.cache}


def pin(autotuners: dict, choices: dict[str, list]) -> None:
    """Put recorded choices (`recorded`'s form) into the autotuners' caches; a kernel name that is not
    among `autotuners` (a record of another version of the kernels) is a ValueError."""
    import triton

    unknown = sorted(set(choices) - set(autotuners))
    if unknown:
        raise ValueError(f"recorded kernel choices for {unknown}, which are not among {sorted(autotuners)}")
    for name, entries in choices.items():
        for key, config in entries:
            autotuners[name].cache[tuple(key)] = triton.Config(
                config["kwargs"], num_warps=config["num_warps"], num_stages=config["num_stages"])


def _config_record(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def attention_choices() -> dict[str, list]:
    """`recorded` for the fused attention's kernels (model/attention_triton.py); {} in a process that
    never loaded them (a CPU run, another attention)."""
    import sys

    kernels = sys.modules.get("model.attention_triton")
    return {} if kernels is None else recorded(kernels.autotuners())


def pin_attention_choices(choices: dict[str, list]) -> None:
    """`pin` for the fused attention's kernels; nothing to do (and Triton not needed) for an empty record."""
    if choices:
        from model import attention_triton

        pin(attention_triton.autotuners(), choices)
