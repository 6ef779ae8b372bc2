"""The step's one agreement carries the machine's faults a single rank saw, a checkpoint write in the
background that failed and a data file the next step cannot read, to every rank (2 gloo ranks), so that
all of them stop after the same step."""

import torch

from distributed import run_distributed


def agreed(seen: list[list[tuple[bool, bool]]]) -> list[tuple[bool, bool, int]]:
    """For each step, (write failed, data failed) as this rank saw them → what the ranks agreed."""
    import torch.distributed as dist

    from train.guard.preemption import StopSignals, agree

    rank, verdicts = dist.get_rank(), []
    for step, faults in enumerate(seen, start=1):
        write, data = faults[rank]
        verdict = agree(step, StopSignals(rank), write_failed=write, data_failed=data)
        verdicts.append((verdict.write_failed, verdict.data_failed, verdict.signal))
    return verdicts


def test_a_fault_one_rank_saw_is_agreed_by_every_rank():
    seen = [[(False, False), (False, False)], [(False, False), (False, True)], [(True, False), (False, False)]]
    expected = [(False, False, 0), (False, True, 0), (True, False, 0)]
    assert run_distributed(agreed, 2, seen) == [expected, expected]
