"""Fixtures shared by test modules; each pytest-xdist worker computes on its share of the cores."""

import os
from collections import Counter

import pytest

from cli import write_corpus

# The test files that take longest under pytest-xdist (CI: 3 workers on 2 cores), longest first. `--dist loadfile`
# sends each file whole to one worker, in the order the files come; pytest-xdist (3.6 on) would order them by
# their number of tests, most first, which leaves the long files of one or two tests (a cluster's faults, the
# chaos run, the offline install) to start last and run on alone at the end. These start first, then every
# other file, most tests first. Only an order: a file missing here, or no longer long, still runs.
LONGEST_FIRST = (
    "tests/end_to_end/test_pipeline_schedules.py",
    "tests/model/test_attention_triton.py",
    "tests/end_to_end/test_layouts.py",
    "tests/cluster/test_slurm_faults.py",
    "tests/end_to_end/test_hub_faults.py",
    "tests/end_to_end/test_elastic.py",
    "tests/scripts/test_offline_install.py",
    "tests/end_to_end/test_machine_faults.py",
    "tests/end_to_end/test_fp8.py",
    "tests/end_to_end/test_evaluate.py",
    "tests/bench/test_recovery_bench.py",
    "tests/train/guard/test_preemption.py",
    "tests/train/guard/test_nonfinite.py",
    "tests/end_to_end/test_any_layout.py",
    "tests/train/data/test_data_hub.py",
    "tests/bench/test_attention_benchmarks.py",
    "tests/end_to_end/test_train_run.py",
    "tests/cluster/test_torchrun_elastic.py",
    "tests/train/checkpoint/test_checkpoint_tamper.py",
    "tests/cluster/test_slurm_layouts.py",
    "tests/end_to_end/test_layouts_data.py",
    "tests/end_to_end/test_first_hour.py",
    "tests/bench/test_benchmarks.py",
    "tests/train/checkpoint/test_checkpoint_layouts.py",
    "tests/cluster/test_deepspeed_runner.py",
    "tests/model/test_compile.py",
    "tests/train/planner/test_plan_cli.py",
    "tests/train/planner/test_plan_schedules.py",
    "tests/train/checkpoint/test_async_checkpoint.py",
    "tests/end_to_end/test_chaos.py",
    "tests/train/data/test_data_prepared.py",
    "tests/bench/test_data_bench.py",
    "tests/train/checkpoint/test_checkpoint_state.py",
    "tests/train/run/test_config_checks.py",
    "tests/train/checkpoint/test_export.py",
    "tests/train/data/test_data_streams.py",
    "tests/train/checkpoint/test_checkpoint_damage.py",
    "tests/train/runtime/test_precision.py",
    "tests/cluster/test_slurm_submission.py",
    "tests/cluster/test_torchrun.py",
    "tests/train/planner/test_plan_activations.py",
    "tests/train/run/test_step_syncs.py",
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The real-text corpus of tests/helpers/cli.py, written once per session (modules may define their own)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def pytest_configure(config):
    """Under pytest-xdist, torch in each worker takes cores / workers threads (at least one): two workers on
    two cores, each with torch's default of one thread per core, would contend for every core. And the files
    go out in the order pytest_collection_modifyitems gives them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    if getattr(config.option, "dist", None) == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # (in the controller) the files in the order given below


def pytest_collection_modifyitems(items):
    """Under pytest-xdist: the files of LONGEST_FIRST first, in its order, then the others, most tests first;
    each file's tests stay together, in their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files = [item.nodeid.split("::")[0] for item in items]
    tests, first, seen = Counter(files), {path: k for k, path in enumerate(LONGEST_FIRST)}, {}
    for k, path in enumerate(files):
        seen.setdefault(path, k)
    rank = {path: (first.get(path, len(first)), 0 if path in first else -tests[path], seen[path]) for path in seen}
    items[:] = [item for _, item in sorted(zip(files, items), key=lambda pair: rank[pair[0]])]
