"""The data-parallel gradient reduction chunk by chunk, while the backward goes on (parallel.overlap_communication,
the interleaved schedule, DeepSpeed's bf16 optimizer).

DeepSpeed's pipeline engine reduces the gradients once, after the step's last backward (ReduceGrads): for its bf16
optimizer it flattens the fp32 gradients, casts them to the communication dtype (bf16 unless
`communication_data_type` says otherwise), all-reduces them over the data-parallel group, scales by 1/dp and
copies them back. Under the interleaved schedule a rank's chunks finish their backward one after another: once
chunk c has run B for all m micro batches of the step, its gradients are final, and the other chunks still have
backward passes to run. `ChunkReductions` then issues chunk c's reduction (asynchronous: NCCL's stream on CUDA,
gloo's thread on the CPU) at the start of the rank's next pass, once that B's input gradient has been sent (so
the send never waits behind the reduction): the same operations on the same values as DeepSpeed's, so the
result is the same bit for bit where the sum's order cannot differ (dp = 2, as tested; at dp > 2 up to the order
in which the all-reduce adds a buffer of another size). The engine's ReduceGrads waits for them and reduces only
what is left: the tied embedding's gradient (its pipeline all-reduce comes first, in ReduceTiedGrads).

With g_c^r chunk c's fp32 gradients on data-parallel rank r, f DeepSpeed's gradient_predivide_factor and the
communication dtype's cast q (bf16 under bf16), each rank ends with g_c = fp32((Σ_r q(g_c^r) / f) · f / dp), in
these steps ("dp grads <virtual stage>" in parallel/comm.py's record_overlap):
  issue    b = q(g_c) (one copy a run of adjacent gradients in the flat fp32 buffers), b ·= 1/f, all-reduce(b)
           without waiting; a chunk's earlier reduction is finished first, so at most two chunks' buffers are
           held (2 bytes a parameter of the chunk in bf16)
  finish   wait, b ·= f/dp, g_c ← b (cast back into the fp32 gradients)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.comm import record_step
from parallel.schedules.orders import SPLIT_BACKWARD


def reduces_chunks(schedule: str, virtual_stages: int, bf16_optimizer: bool, dp: int) -> bool:
    """Whether a rank's chunks have their gradients reduced one by one (`ChunkReductions`): several chunks a rank and W
    not split off (the interleaved schedule: under zb-h1 and zb-v a chunk's gradients are final only after its W
    passes), DeepSpeed's bf16 optimizer (whose fp32 gradients the reduction casts and sums), other data-parallel
    ranks. The engine and the planner (train/planner/estimate.py: chunk_reductions_run) both ask this."""
    return virtual_stages > 1 and schedule not in SPLIT_BACKWARD and bf16_optimizer and dp > 1


class ChunkReductions:
    """Issues each chunk's data-parallel gradient reduction when its last B of the step has run (module docstring).

    engine: the ScheduleEngine (its optimizer is DeepSpeed's bf16 optimizer, its data-parallel group has other
    ranks); placed: {virtual stage: (group, index) in the bf16 optimizer of each of the chunk's parameters}, the
    tied ones left out."""

    def __init__(self, engine, placed: dict[int, list[tuple[int, int]]]):
        self.runs = {stage: _runs(engine.optimizer, at) for stage, at in placed.items() if at}
        self.group = engine.mpu.get_data_parallel_group()
        self.dp = dist.get_world_size(self.group)
        self.dtype = engine.communication_data_type
        self.average, self.postscale = engine.gradient_average, engine.postscale_gradients()
        self.predivide = engine.gradient_predivide_factor()
        self.reduced: set[int] = set()  # id() of the fp32 gradients reduced this step
        self._backwards: dict[int, int] = {}  # virtual stage → the B passes it has run this step
        self._due: list[int] = []  # virtual stages whose gradients are final, their reduction not yet issued
        self._pending: list[tuple[int, list, torch.Tensor, object]] = []  # (stage, runs, buffer, work) in flight

    def start_step(self) -> None:
        """A step begins: no B has run, nothing is reduced. A step that raised with reductions still in flight
        leaves gradients half reduced: the next one refuses to start on them."""
        if self._pending or self._due:
            raise RuntimeError(f"data-parallel reductions of stages {[p[0] for p in self._pending] + self._due} "
                               "never finished: the step that issued them did not end")
        self._backwards, self.reduced = {}, set()

    def after_backward(self, stage: int, micro_batches: int) -> None:
        """Virtual stage `stage` ran a B; after its `micro_batches`-th this step its gradients are final, and their
        reduction is due (issued by `issue_due`, at the start of the next pass)."""
        self._backwards[stage] = self._backwards.get(stage, 0) + 1
        if self._backwards[stage] == micro_batches and stage in self.runs:
            self._due.append(stage)

    def issue_due(self) -> None:
        """Issue the reductions that are due, each once the one before it has finished."""
        for stage in self._due:
            self._finish_pending()
            self._issue(stage)
        self._due = []

    def finish(self) -> set[int]:
        """Issue what is due, wait for every reduction issued this step and write the results into the fp32
        gradients; returns the id() of every gradient reduced (ReduceGrads reduces the others)."""
        self.issue_due()
        self._finish_pending()
        return self.reduced

    def _issue(self, stage: int) -> None:
        runs = self.runs[stage]
        total = sum(run.numel() for run, _ in runs)
        buffer = torch.empty(total, dtype=self.dtype, device=runs[0][0].device)  # (Σ chunk elements,)
        offset = 0
        for run, _ in runs:
            buffer[offset : offset + run.numel()].copy_(run)
            offset += run.numel()
        if self.average and self.postscale and self.predivide != 1.0:
            buffer.mul_(1.0 / self.predivide)
        elif self.average and not self.postscale:
            buffer.mul_(1.0 / self.dp)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        record_step("issue", f"dp grads {stage}")
        self._pending.append((stage, runs, buffer, work))

    def _finish_pending(self) -> None:
        for stage, runs, buffer, work in self._pending:
            work.wait()
            record_step("wait", f"dp grads {stage}")
            if self.average and self.postscale and self.predivide != self.dp:
                buffer.mul_(self.predivide / self.dp)
            offset = 0
            for run, members in runs:
                run.copy_(buffer[offset : offset + run.numel()])
                offset += run.numel()
                self.reduced.update(id(g) for g in members)
        self._pending = []


def _runs(optimizer, placed: list[tuple[int, int]]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The fp32 gradients of the parameters at `placed` ((group, index) in the bf16 optimizer) as the fewest 1-d
    views of its flat gradient buffers, each spanning gradients adjacent there: [(view, the gradients it spans)]."""
    runs: list[tuple[int, int, int, list]] = []  # (group, start, end, members), offsets in the group's flat buffer
    for i, j in sorted(placed, key=lambda at: (at[0], optimizer.fp32_groups_gradients[at[0]][at[1]].storage_offset())):
        flat, grad = optimizer.fp32_groups_gradients_flat[i], optimizer.fp32_groups_gradients[i][j]
        start = grad.storage_offset() - flat.storage_offset()
        if runs and runs[-1][0] == i and runs[-1][2] == start:
            runs[-1] = (i, runs[-1][1], start + grad.numel(), runs[-1][3] + [grad])
        else:
            runs.append((i, start, start + grad.numel(), [grad]))
    return [(optimizer.fp32_groups_gradients_flat[i].narrow(0, start, end - start), members)
            for i, start, end, members in runs]
