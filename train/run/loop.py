"""What one run does: build, resume, then step, log, evaluate and checkpoint until max_steps, finish.

One optimizer step = one global batch of `train.global_batch_size` windows, or, under a batch-size
ramp (`train.batch_ramp`, train/run/batch_ramp.py), of the ramp's size at the tokens seen so far. This
rank takes its data-parallel slice (global / dp windows) and runs it as micro batches of
`train.micro_batch_size` (train/run/step.py); DeepSpeed accumulates and steps at the boundary. The
learning rate follows the tokens seen (train/run/optimizer.py: TokenLR).

The run speaks at once: its first line (the model, layout, data, tokens per step and run folder) comes
before anything is built (under fp8 a second: which linears compute in float8, and whether the blocks compile), the first step of each start has its line as soon as it ends, then one every
`logging.log_interval` steps, each with the time left; on a terminal a progress bar shows the steps between.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from train.config.launch import is_rank_zero
from train.data import DataUnavailable
from train.data.records import ENCODING_HINT
from train.guard.safeguards import Safeguards
from train.monitor import charts, metrics, report
from train.monitor.metrics import Meter, mean_over_ranks
from train.run.build import Progress, Trainer, build, header
from train.run.spec import RunSpec

BAR_WIDTH = 24  # the progress bar's cells


def run(spec: RunSpec, trainer: Trainer | None = None) -> Progress:
    """Train per `spec` (train/run/spec.py: resolve); returns the final step and token count. `trainer`: the run
    already built from `spec` (train/run/build.py), as bench/step_bill.py builds it before its loop runs on
    fake tensors; else built here."""
    report.say(header(spec), is_rank_zero())
    if spec.fp8_line is not None:  # which linears compute in float8, and how the blocks run
        report.say(spec.fp8_line, is_rank_zero())
    trainer = trainer if trainer is not None else build(spec)
    checkpoints = trainer.checkpointer
    resumed_from = checkpoints.restore()
    if resumed_from is not None:
        trainer.batches.start()  # background workers (data.workers) begin packing from the restored position
    progress = trainer.progress
    # rows after the step this run starts from (0: none) are from a run killed before its next checkpoint
    logger = open_logger(trainer, progress.step)
    meter = Meter(trainer.device, trainer.topology.world_size, spec.model, metrics.peak_tflops(trainer.device, spec.sections.logging.peak_tflops),
                  trainer.batches, spec.plan, spec.run_tokens)
    guard = Safeguards(spec.sections.train, spec.run_dir, trainer.engine, trainer.topology.rank, lambda text: trainer.say(text),
                       resumed_from)
    checkpoints.connect(guard, logger)
    trainer.say(f"training steps {progress.step + 1}–{spec.sections.train.max_steps}: a progress line every "
                  f"{spec.sections.logging.log_interval} steps")
    try:
        stopped = loop(trainer, progress, logger, meter, guard)
    except BaseException as err:
        report.clear_status()  # the error's line starts a line of its own
        if isinstance(err, Exception):  # not on a second Ctrl-C
            checkpoints.close()
        trainer.batches.close()
        logger.close()
        raise
    finally:
        guard.close()
    finish(trainer, logger, sample=not stopped)
    return progress


def loop(trainer: Trainer, progress: Progress, logger: metrics.MetricsLogger, meter: Meter, guard: Safeguards
         ) -> bool:
    """Step, log (+ evaluate), checkpoint until train.max_steps; True when a signal stopped it early.

    After every step the checkpointer (train/checkpoint/checkpointer.py) saves when a save is due. A
    step's metrics record is logged before that, so a checkpoint never holds a step whose record a kill
    could lose; a record carries the checkpoint times of the saves before it (train/checkpoint/writer.py),
    and the last step's record, logged after the final save and its write, that save's too. A save in
    the background is announced at the first step boundary after its write ended, and the last step's,
    and a stop's, are waited for.

    Faults (train/guard/safeguards.py): a step skipped for a non-finite loss or gradient is counted (decided
    on the device, it is read with the step's record or checkpoint, else one step later), and too many in a
    row raise NonFiniteError; SIGTERM / SIGINT / SIGUSR1 on any rank end the loop on every
    rank after the step with a checkpoint; a step that hangs ends the process from the watchdog's thread.
    The machine's faults: a save the disk refuses raises StorageError (train/checkpoint/storage.py), a write
    in the background at the end of the step it failed in; the next step's data is read before the step's
    agreement, and a data file that stays unreadable on any rank ends the loop on every rank after the step
    with a checkpoint, raising DataUnavailable (train/data/reading.py); at the first step of a start there
    is nothing new to save."""
    settings, last, checkpoints = trainer.sections, trainer.sections.train.max_steps, trainer.checkpointer
    first = progress.step + 1  # this start's first step: its line comes as soon as it ends
    while progress.step < last:
        guard.step_begins(progress.step + 1)
        try:
            windows, size = next_batch(trainer, progress)  # read ahead (`read_ahead`), but at a start's first step
        except DataUnavailable as err:
            raise _data_gone(err, progress, guard.last_checkpoint, trained=False) from None
        result = trainer.step(windows)
        tokens = size * trainer.model_cfg.seq_len
        progress.advance(tokens)
        meter.add(result.loss, size, result.skipped)
        guard.after_step(progress.step, result, tokens)  # its outcome queued on the device; the step before settled
        logs = _due(progress.step, settings.logging.log_interval, last)
        if logs or progress.step == first or checkpoints.due(progress.step, last=progress.step == last):
            guard.settle()  # the device is read here anyway: this step's outcome is known at once
        record = None
        if logs:
            record = meter.take(progress, result, guard.skips.total)
            if trainer.val_batches and _due(progress.step, settings.train.eval_interval, last):
                guard.phase(f"evaluation after step {progress.step}")
                record["val/loss"] = evaluate(trainer)
            tasks_interval = settings.train.eval_tasks_interval or settings.train.eval_interval
            if trainer.spec.eval_tasks and _due(progress.step, tasks_interval, last):
                guard.phase(f"task evaluation after step {progress.step}")
                record.update(score_tasks(trainer))
            trainer.say(_progress_line(record, last, meter.eta_s))
            meter.restart()
        elif progress.step == first:  # not a record: the next one still covers this step
            glance = meter.glance(progress, result, guard.skips.total)
            trainer.say(_progress_line(glance, last, meter.eta(progress.tokens, glance["perf/tokens_per_s"])))
        else:
            report.status(_bar(progress.step, last, meter.eta(progress.tokens)), trainer.topology.rank == 0)
        if record is not None and progress.step < last:
            # before the save: a checkpoint is never published ahead of the records of the steps it holds
            logger.log({**record, **checkpoints.times()})
            record = None
        try:
            guard.check_skips(trainer.device)  # too many skipped in a row: NonFiniteError
            with meter.paused():  # saving time is not training throughput
                checkpoints.save(progress.step, last=progress.step == last)  # the last one written before its record
        finally:  # also when the run stops with an error here: the step's record is logged
            if record is not None:
                logger.log({**record, **checkpoints.times()})
        unreadable = read_ahead(trainer, progress)
        verdict = guard.agree(progress.step, data_failed=unreadable is not None)  # the step's one agreement
        if verdict.write_failed or verdict.data_failed or verdict.signal:
            guard.settle()  # the run ends after this step: its outcome is counted before the save
        if verdict.write_failed:  # a write in the background failed: the run ends here, raising it on every rank
            checkpoints.save(progress.step, last=True)
        if verdict.data_failed:  # the model and the data position are this step's: saved, then the run stops
            checkpoints.save(progress.step, last=True)
            raise _data_gone(unreadable or DataUnavailable(None, "its own line names the file", 0), progress,
                             guard.last_checkpoint, trained=True)
        if verdict.signal:
            checkpoints.save(progress.step, last=True)  # the run ends here: saved (unless it just was), written
            guard.stopped(progress.step, verdict, guard.last_checkpoint, finished=progress.step == last)
            return progress.step < last
    return False


def next_batch(trainer: Trainer, progress: Progress) -> tuple[torch.Tensor, int]:
    """This rank's windows of the next global batch and that batch's size in sequences: the ramp's
    size at the tokens consumed so far (train.batch_ramp; else train.global_batch_size). The learning
    rate is set for the tokens trained on once this batch is (TokenLR.next_step)."""
    size = trainer.ramp.size_at(progress.tokens)
    windows = trainer.batches.next_batch(size)
    trainer.lr.next_step(size * trainer.model_cfg.seq_len)
    return windows, size


def read_ahead(trainer: Trainer, progress: Progress) -> DataUnavailable | None:
    """Read the next step's batch now, without taking it (TrainBatches.ready), so that a data file that stays
    unreadable is known before the step's agreement, where every rank hears of it while all of them can still
    save; that error, or None (also after the last step)."""
    if progress.step >= trainer.sections.train.max_steps:
        return None
    try:
        trainer.batches.ready(trainer.ramp.size_at(progress.tokens))
    except DataUnavailable as err:
        return err
    return None


def _data_gone(err: DataUnavailable, progress: Progress, checkpoint: Path | None, trained: bool) -> DataUnavailable:
    """What data that stayed unreadable (a file, or a Hub that stayed unanswered) stops the run with: where it
    stopped, the checkpoint it resumes from (`trained`: after a step of this start, saved by now; else before
    its first step) and what brings the data back."""
    if trained:
        where = f"stopped after step {progress.step}, checkpoint {checkpoint}"
    else:
        where = f"stopped before step {progress.step + 1}, nothing trained since {checkpoint or 'the start'}"
    return err.stopped(f"{where}; {err.remedy}: it resumes there")


def open_logger(trainer: Trainer, resumed_step: int | None) -> metrics.MetricsLogger:
    """metrics.jsonl and W&B, on rank 0 only; records after `resumed_step` are dropped (see MetricsLogger).
    W&B gets the resolved config (metrics.run_record; under fp8 run.fp8, the linears in float8) and, by default, a
    name saying model and layout; the first
    record of each start holds its layout (layout/*), with parallel.layout=auto also why it was chosen."""
    topo, spec = trainer.topology, trainer.spec
    layout = {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size, "zero_stage": trainer.sections.parallel.zero_stage,
              "micro_batch": trainer.sections.train.micro_batch_size,
              "activation_checkpointing": trainer.sections.parallel.activation_checkpointing}
    first = {f"layout/{key}": value for key, value in layout.items()}
    if spec.layout is not None:  # parallel.layout=auto: what it chose and why
        layout["auto"], first["layout/auto"] = spec.layout.to_json(), spec.layout.line()
    run_config = metrics.run_record({**trainer.sections.record(), "model": dataclasses.asdict(spec.model)}, spec.schedule.schedule, layout,
                                    trainer.ramp.full, spec.model.seq_len, trainer.plan)
    if spec.fp8 is not None:  # which linears compute in float8 (the run's line, as data), and how the blocks run
        run_config["run"]["fp8"] = {**spec.fp8.to_json(), "line": spec.fp8_line, "blocks": spec.fp8_blocks}
    name = f"{spec.model.name}-tp{topo.tp_size}pp{topo.pp_size}dp{topo.dp_size}-{trainer.run_dir.name}"
    return metrics.MetricsLogger(trainer.run_dir, trainer.sections.logging, run_config, active=topo.rank == 0,
                                 resumed_step=resumed_step, resumed=spec.resume is not None, default_name=name,
                                 first_record=first)


def evaluate(trainer: Trainer) -> float:
    """Mean next-token loss over the held-out windows, averaged over all ranks."""
    return mean_over_ranks(_mean(trainer.step.evaluate(trainer.val_batches)))


def score_tasks(trainer: Trainer) -> dict:
    """{eval/<task>/<metric>: value} of train.eval_tasks on the model as it stands (every rank takes part;
    the same numbers at every layout: train/evaluation/suite.py)."""
    from train.evaluation import evaluate_tasks

    return evaluate_tasks(trainer.engine.module, trainer.model_cfg, trainer.topology, list(trainer.spec.eval_tasks),
                          trainer.sections.evaluate.batch_tokens, trainer.spec.runtime.bf16_products)


def finish(trainer: Trainer, logger: metrics.MetricsLogger, sample: bool = True) -> None:
    """The data summary (bad records skipped, per file), the end-of-run sample (every rank takes
    part: stages pass activations, tp ranks share logits; none after a stop on a signal), then the
    data workers and the logger stop, and rank 0 draws the run's curves (logging.curves)."""
    train = trainer.sections.train
    bad = trainer.batches.bad_records(gather=True)  # a collective when ranks read different streams
    if bad:
        total = sum(n for reasons in bad.values() for n in reasons.values())
        lines = [f"  {file}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
                 for file, reasons in sorted(bad.items())]
        hint = ENCODING_HINT if any("undecodable" in reasons for reasons in bad.values()) else ""
        trainer.say(f"data: {total} bad record(s) skipped (data.on_bad_record=skip){hint}:\n" + "\n".join(lines))
        logger.summary({"data/bad_records": total})
    if sample and train.sample_tokens > 0:
        from train.evaluation.sample import sample_text

        text, _ = sample_text(trainer.engine.module, trainer.model_cfg, trainer.topology, train.sample_prompt,
                              train.sample_tokens, trainer.device, train.seed, bf16=trainer.spec.runtime.bf16_products)
        trainer.say("sample:\n" + text)
        logger.sample(trainer.progress.step, train.sample_prompt, text)
    trainer.batches.close()
    logger.close()
    if trainer.sections.logging.curves and trainer.topology.rank == 0:
        trainer.say(charts.after_run(trainer.run_dir))


def _due(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def _progress_line(record: dict, max_steps: int, eta: float) -> str:
    loss = record["train/loss"]
    parts = [
        f"step {record['step']:>{len(str(max_steps))}}/{max_steps}",
        f"loss {loss:.4f}" if loss is not None else "loss -",
        f"lr {record['train/lr']:.2e}",
    ]
    if record["train/grad_norm"] is not None:
        parts.append(f"grad {record['train/grad_norm']:.2f}")
    if record["train/skipped_steps"]:
        parts.append(f"skipped {record['train/skipped_steps']}")
    if "val/loss" in record:
        parts.append(f"val {record['val/loss']:.4f}")
    parts.append(f"{record['perf/tokens_per_s']:,.0f} tok/s")
    if record["perf/mfu"] is not None:
        predicted = record.get("perf/mfu_predicted")
        plan = f" (plan {100 * predicted:.1f}%)" if predicted is not None else ""
        parts.append(f"mfu {100 * record['perf/mfu']:.1f}%{plan}")
    parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


def _bar(step: int, max_steps: int, eta: float) -> str:
    """The terminal's progress bar after `step` of `max_steps`."""
    done = BAR_WIDTH * step // max_steps
    return f"step {step}/{max_steps} [{'#' * done}{'.' * (BAR_WIDTH - done)}] {100 * step // max_steps}% | eta {_duration(eta)}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
