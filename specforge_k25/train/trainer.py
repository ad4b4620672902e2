"""One training run as a small `Trainer` with named steps (resume, train a micro-batch, optimizer
step, evaluate, save, summarize) over the batch schedule (train/schedule.py):

    setup (setup/run.py) -> target process -> stream -> draft + its loss -> AdamW
    -> checkpoints -> serving export -> summary

What each rank reads of the stream is train/stream_routing.py's; a regenerating run's answers are
train/regenerated.py's; what the run wrote to disk is train/disk.py's.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import JobConfig
from ..data.regenerate import regeneration_prompt
from ..export.serving import export_draft
from ..setup.run import RunSetup
from ..setup.target import make_target_stream
from . import memory_report
from ..stream.target_stream import StreamError, StreamInterrupted, TargetStream
from ..target_engine.routing import load_counts
from .checkpoint import (WriteFailed, check_draft_keys, last_good_checkpoint, list_checkpoints, optimizer_state_for,
                         pick_checkpoint, read_checkpoint, read_state, save_checkpoint)
from .finite import NonFiniteError, diverged, diverged_message, nonfinite_weights
from .run_lock import RunFolderLocked, RunLock
from .distributed import RankFailed, Ranks, launcher_env_hidden
from .disk import allocated_bytes, disk_summary, written_bytes
from .fingerprint import (RESHARDABLE, check_fingerprint, fingerprint_defaults, run_fingerprint, unrecorded,
                          with_recorded_optimizer)
from .feed import rebuild_regenerated, take_batches
from .metrics import MetricsLogger, NullLogger, LossStats
from .regenerated import COLUMNS, RegenerationBook
from .answer_store import answer_provenance
from .overview import eval_line, print_overview
from .schedule import BatchItem, build_schedule
from .learner import batch_seed, build_learner, release_cached_memory
from .stream_routing import batches_run_before, open_stream, route
from .stop import StopOnSignal, TrainingInterrupted


@dataclass
class Progress:
    """Counters at the last optimizer-step boundary: what a checkpoint records and a resume restores."""

    step: int = 0
    micro_batches: int = 0
    schedule_item: int = 0  # the data cursor: the next item of the schedule to run
    tokens_trained: int = 0
    samples_trained: int = 0


# -------------------------------------------------------------------------------- trainer
class Trainer:
    """The training loop of one trainer rank. Every rank walks the whole schedule (the collectives
    line up) and reads its stream only for the items it has a share of; only rank 0 prints, logs,
    checkpoints and exports."""

    def __init__(self, job: JobConfig, setup: RunSetup, run_dir: Path, ranks: Ranks,
                 stream_factory=make_target_stream, t_start: float | None = None):
        tr = job.train
        self.job, self.setup, self.run_dir, self.ranks = job, setup, Path(run_dir), ranks
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stream_factory = stream_factory
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.device = torch.device("cuda", job.hw.trainer_gpu) if job.hw.device == "cuda" else torch.device("cpu")
        # The schedule is over GLOBAL batches (train.batch_size per rank x ranks); rank r trains on slice r of each.
        self.schedule, self.steps = build_schedule(
            len(setup.data.train), len(setup.data.heldout), batch_size=tr.batch_size * ranks.world // ranks.cp,
            grad_accum=tr.grad_accum, epochs=tr.epochs, max_steps=tr.max_steps, eval_every=tr.eval_every, seed=tr.seed,
            lengths=[len(s.input_ids) for s in setup.data.train] if tr.group_by_length else None)
        self.learner = build_learner(job, setup, self.steps, self.device, ranks)
        self.fingerprint = run_fingerprint(job, setup, len(self.schedule), ranks.world)
        self.samples = setup.data.train + setup.data.heldout
        self.saved = Progress()  # at the last optimizer-step boundary
        self.progress = Progress()  # live, item by item
        self.evals: dict[str, dict] = {}
        self.resumed_from: Path | None = None
        self.checkpoint: Path | None = None
        self.held_lock: RunLock | None = None  # the run folder's lock, taken already (train/__main__.py)
        self.artifact_bytes = 0  # bytes of checkpoints and export this rank wrote (to separate them from anything else)
        self.stop = StopOnSignal()
        self.logger = NullLogger()
        self.bar = None
        self.stream: TargetStream | None = None
        self._eval: tuple[str, LossStats] | None = None  # the evaluation under way: (tag, stats)
        self._train_stats = LossStats()
        self._t_train: float | None = None  # set at the first training batch: throughput excludes start-up
        self._wait_at_train_start = 0.0
        self._session_tokens = self._tokens_streamed = 0
        self._positions = [0, 0]  # this session's real and padded positions of this rank's training batches
        self.regeneration = (RegenerationBook(
            self.run_dir, setup.tokenizer, self.samples, setup.regeneration.budget,
            answer_provenance(job, setup.regeneration, self.fingerprint["target_digest"]), ranks, job.data.regen_source)
            if setup.regeneration is not None else None)

    # ------------------------------------------------------------------------------ steps
    def resume(self) -> None:
        """Weights, Adam, LR, RNG, vocab maps and the data cursor from the newest checkpoint (train.resume)."""
        path = self._resume_checkpoint()
        if path is not None:
            state = read_state(path)
            saved = fingerprint_defaults(with_recorded_optimizer(state.get("fingerprint", {}), state))
            check_fingerprint(saved, self.fingerprint, path)
            t = self.learner
            state, tensors, optim = read_checkpoint(path)
            check_draft_keys(path, t.draft, tensors)
            names = [name for name, p in t.draft.named_parameters() if p.requires_grad]
            t.load_state_dicts(tensors, optimizer_state_for(optim, t.optimizer, names, by_name=t.sharded))
            t.scheduler.load_state_dict(state["scheduler"])
            self.saved = Progress(**{k: state[k] for k in dataclasses.asdict(Progress())})
            self.evals = state.get("evals", {})
            self.resumed_from = path
            if self.ranks.main:
                print(f"resuming from {path} at optimizer step {self.saved.step} "
                      f"(schedule item {self.saved.schedule_item})")
                if unrecorded(saved, self.fingerprint):
                    print(f"  note: this checkpoint predates recording {', '.join(unrecorded(saved))}: not "
                          f"compared, the current values apply")
                if any(saved[k] != self.fingerprint[k] for k in RESHARDABLE):
                    print(f"  saved by {saved['trainer_ranks']} {saved['trainer_layout']} trainer rank(s) x batch "
                          f"{saved['batch_size']}, resumed on {self.ranks.world} {self.job.hw.trainer_layout} x batch "
                          f"{self.job.train.batch_size}: the same global batches")
        self.ranks.check_same(self.saved.schedule_item, "the schedule item to resume from", self.device)

    def _resume_checkpoint(self) -> Path | None:
        """train.resume's checkpoint, verified by rank 0 (its manifest: `pick_checkpoint`) and the
        choice, or the refusal, handed to every rank."""
        picked = None
        if self.ranks.main:
            try:
                path, notes = pick_checkpoint(self.job.train.resume, self.run_dir)
                picked = (str(path) if path else None, notes, None)
            except (ValueError, FileNotFoundError) as err:
                picked = (None, [], str(err))
        path, notes, refusal = self.ranks.from_main(picked)
        if refusal:
            raise ValueError(refusal)
        if self.ranks.main:
            for note in notes:
                print(f"resume: {note}", flush=True)
        return Path(path) if path else None

    def train_micro_batch(self, index: int, item: BatchItem, batch, tokens: int) -> None:
        """Forward + backward of this rank's share of a training item (`tokens`: the whole item's);
        an optimizer step at every train.grad_accum-th one."""
        if self._t_train is None:
            self._t_train, self._wait_at_train_start = time.perf_counter(), self.stream.wait_s
            memory_report.at_stream_start(self)  # the target has started: its memory beside the plan's
        res = self.learner.train_micro(batch)  # None: no share of this micro-batch (it still joins the counts)
        if batch is not None:
            self._positions[0] += int(batch.lengths.sum())
            self._positions[1] += batch.input_ids.numel()
        if res is not None:
            self._train_stats.add(res)
        p = self.progress
        p.micro_batches += 1
        p.tokens_trained += tokens
        p.samples_trained += len(item.sample_ids)
        self._session_tokens += tokens
        if p.micro_batches % self.job.train.grad_accum == 0:
            self.optimizer_step(index, res)

    def optimizer_step(self, index: int, last) -> None:
        tr, p = self.job.train, self.progress
        grad_norm = self.learner.optimizer_step()
        p.step += 1
        p.schedule_item = index + 1
        self.saved = dataclasses.replace(p)
        elapsed = time.perf_counter() - self._t_train
        loss = self.learner.loss_value(last)
        reason = diverged(p.step, loss, grad_norm)  # the same numbers on every rank: all stop here
        if reason:
            raise NonFiniteError(reason)
        log_now = p.step % tr.log_every == 0 or p.step == self.steps
        if log_now:
            self.learner.sum_stats(self._train_stats)
        summary = self._train_stats.summary("train")
        self.bar.set_postfix(tok_s=f"{self._session_tokens / elapsed:.0f}", loss=f"{loss:.3f}",
                             acc0=f"{summary.get('train/acc_0', 0):.2f}", q=self.stream.depth())
        self.bar.update(1)
        if log_now:
            self.logger.log({**summary, "train/loss": loss, "train/grad_norm": grad_norm,
                             "train/lr": self.learner.scheduler.get_last_lr()[0],
                             "perf/tokens_per_s": self._session_tokens / elapsed, "stream/depth": self.stream.depth(),
                             "stream/wait_frac": self.stream.wait_s / elapsed}, p.step)
            self._train_stats = LossStats()
        if tr.checkpoint_every and p.step % tr.checkpoint_every == 0 and p.step < self.steps:
            self._check_weights(f"the weights after optimizer step {p.step}")
            self.save()

    def evaluate(self, item: BatchItem, batch) -> None:
        """One held-out batch of the evaluation `item.tag`; its metrics are logged when it ends."""
        if self._eval is None:
            self._eval = (item.tag, LossStats())
        result = self.learner.evaluate(batch)  # sharded, without a share: FSDP's collectives still run
        if result is not None:
            self._eval[1].add(result)

    def finish_evaluation(self) -> None:
        if self._eval is None:
            return
        tag, stats = self._eval
        self._eval = None
        self.evals[tag] = {k.split("/", 1)[1]: v for k, v in self.learner.sum_stats(stats).summary("eval").items()}
        self.logger.log({**{f"eval/{k}": v for k, v in self.evals[tag].items()},
                         "eval/tokens_trained": self.progress.tokens_trained}, self.progress.step)
        if self.ranks.main:
            self.bar.write(f"eval[{tag}] " + eval_line(self.evals[tag], self.learner.depth))

    def save(self, done: bool = False) -> Path | None:
        """Checkpoint at the last optimizer-step boundary, written by rank 0 (replicated ranks hold
        equal weights; sharded ones first gather the full state: every rank calls this).
        done: the whole schedule ran (a resume has nothing left to do)."""
        t = self.learner
        if not (self.ranks.main or t.sharded) or (self.saved.step == 0 and not done):
            return None  # step 0: nothing a fresh start lacks (and no AdamW state for FSDP2 to gather)
        self.ranks.phase("checkpoint")
        tensors, optim = t.state_dicts()
        if not self.ranks.main:
            return None
        extra = {**dataclasses.asdict(self.saved), "evals": self.evals, "fingerprint": self.fingerprint}
        if done:
            extra["schedule_item"] = len(self.schedule)
        try:
            self.checkpoint = save_checkpoint(self.run_dir, self.saved.step, tensors, optim, t.scheduler.state_dict(),
                                              extra, self.job.train.keep_checkpoints)
        except OSError as err:  # a full disk, a permission, a vanished folder: the partial folder is gone
            raise WriteFailed(f"the checkpoint of optimizer step {self.saved.step} was not written: {err}") from None
        self.artifact_bytes += allocated_bytes(self.checkpoint)
        return self.checkpoint

    def _check_weights(self, what: str) -> None:
        """NonFiniteError on every rank when any rank's weights (its shards) hold NaN or inf: a
        collective with several ranks, made where every rank is (an optimizer step, the end)."""
        bad = nonfinite_weights(self.learner.draft)
        if self.ranks.distributed:
            bad = self.ranks.sum_ints([bad], self.device)[0]
        if bad:
            raise NonFiniteError(f"training diverged: {what} hold NaN or inf ({bad} tensors)")

    # -------------------------------------------------------------------------------- run
    def run(self) -> dict:
        """`_run` holding the run folder's lock (rank 0; every rank refuses when it is taken)."""
        lock, refusal = self.held_lock or RunLock(self.run_dir), None
        if self.ranks.main and self.held_lock is None:
            try:
                lock.acquire()
            except RunFolderLocked as err:
                refusal = str(err)
        refusal = self.ranks.from_main(refusal)
        if refusal:
            raise RunFolderLocked(refusal)
        try:
            if lock.takeover_note():
                print(lock.takeover_note(), flush=True)
            return self._run()
        finally:
            lock.release()

    def _run(self) -> dict:
        """Train over the schedule and export. Returns the summary (also written to summary.json).

        Raises TrainingInterrupted (after saving) on SIGTERM/SIGINT, and StreamError / RankFailed
        (after saving) when the target process fails, dies or stalls or another rank fails."""
        tr = self.job.train
        self.resume()
        self.progress = dataclasses.replace(self.saved)
        start = self.saved.schedule_item
        if self.ranks.main:
            print_overview(self.job, self.setup, self.schedule, self.steps, self.learner.draft, self.run_dir,
                           self.ranks.world)
            self.logger = MetricsLogger(tr.logger, project=tr.wandb_project, mode=tr.wandb_mode,
                                        run_dir=str(self.run_dir), config={"job": dataclasses.asdict(self.job),
                                                                           "capture_points": self.setup.capture_points})
        sizes = [self._floor_tokens(i) for i in range(len(self.samples))]
        routes = route(self.schedule[start:], self.ranks, tr.batch_size, sizes)
        stream_args = {}
        if self.regeneration is not None:  # answers saved already: never decoded again
            stream_args["known"] = self.regeneration.saved_answers({i for b in routes.batches for i in b})
            if start:  # the batches that place the rest in their decode groups
                stream_args["before"] = batches_run_before(self.schedule[:start], self.ranks, tr.batch_size, sizes)
        self.stream = open_stream(self.stream_factory, self.job, self.setup, self.samples, self.ranks, routes, sizes,
                                  **stream_args)
        if self.ranks.main and tr.routing_capture and getattr(self.stream, "spec", None) is not None:
            self.stream.spec.routing_dir = str(self.run_dir)  # MoE routing counts for serving/ (target_engine/routing.py)
        # Sharded ranks keep waiting for their batch after a stop signal (once there is progress to
        # save): they stop together at the next schedule item, where they can gather their state.
        self.stream.should_stop = lambda: self.stop.requested() and not (self.learner.sharded and self.saved.step)
        self.bar = tqdm(total=self.steps, initial=self.saved.step, desc="train", unit="step",
                        disable=not (tr.progress and self.ranks.main), dynamic_ncols=True)
        release_cached_memory(self.device)  # before the target measures the GPU's free memory (train/learner.py)
        try:
            with self.stop, launcher_env_hidden(), self.stream:  # the target must not inherit torchrun's variables
                written_before = written_bytes()
                self._walk(start, routes.shares)
                trainer_written = written_bytes() - written_before
            self.bar.close()
            self._check_weights("the trained weights")
            self.save(done=True)
            draft = self.learner.plain_draft() if (self.ranks.main or self.learner.sharded) else None
            export = self._export(draft) if self.ranks.main else None
        except (TrainingInterrupted, StreamInterrupted, StreamError, RankFailed) as err:
            raise self._saved_on_failure(err) from None
        except NonFiniteError as err:
            raise self._failed(err, NonFiniteError, diverged_message) from None
        except WriteFailed as err:
            raise self._failed(err, WriteFailed, lambda e, path, run: (
                f"{e}\nprogress saved: {path or 'no checkpoint yet'} (resume with train.resume=auto "
                f"train.out_dir={run})")) from None
        finally:
            self.bar.close()
            self.stream.close()
        return self.summarize(trainer_written, export)

    def _walk(self, start: int, shares: list[list[int]]) -> None:
        regen = self.setup.regeneration
        rebuild = rebuild_regenerated(regen, self.job.data.regen_cut) if regen is not None else None
        # each sequence's random draws (DFlash's anchors) seeded by the run's seed, the item and the
        # sample: a resume draws the same, any layout (dedicated, co-located, any rank count) draws the
        # same for a sample, and an evaluation draws the same for a sample at every eval item
        seeds = iter([[batch_seed(self.job.train.seed, *(("eval",) if self.schedule[i].kind == "eval" else ("train", i)), s)
                       for s in share] for i, share in enumerate(shares, start) if share])
        batches = take_batches(self.stream, shares, self.samples,
                               lambda *args: self.learner.make_batch(*args, seeds=next(seeds)), rebuild)
        marked = self.ranks.marked(batches, start, lambda i: self.schedule[i].kind, self.run_dir)  # the heartbeat's phases
        for index, (share, batch, regenerated) in enumerate(marked, start):
            item = self.schedule[index]
            tokens = self._item_tokens(item, batch, share, regenerated)
            self._tokens_streamed += tokens
            if self._stop_agreed():
                raise TrainingInterrupted(self.stop.signum or signal.SIGTERM, None)
            if item.kind == "eval":
                self.evaluate(item, batch)
                continue
            self.finish_evaluation()
            self.train_micro_batch(index, item, batch, tokens)
        self.finish_evaluation()

    def _stop_agreed(self) -> bool:
        """A stop signal seen by any rank, agreed on by all at the same schedule item (a collective
        per item with several ranks), so that sharded ranks gather their state together."""
        if not self.ranks.distributed:
            return self.stop.requested()
        return bool(self.ranks.sum_ints([int(self.stop.requested())], self.device)[0])

    def _export(self, draft) -> Path:
        try:
            return export_draft(draft, self.run_dir / "export", self.setup.sglang_capture_ids,
                                self.setup.info.bos_token_id, self.setup.info.eos_token_id,
                                capture_points=self.setup.capture_points, end_of_turn_id=self.setup.end_of_turn_id)
        except OSError as err:  # the export's partial folder is removed (publish_folder)
            raise WriteFailed(f"the export {self.run_dir / 'export'} was not written: {err}") from None

    def _failed(self, err: Exception, kind: type, message) -> Exception:
        """A run that cannot save its progress now (it diverged; a write failed): the target
        stopped, the newest intact checkpoint named, summary.json saying it failed."""
        self.ranks.phase("stopping")
        self.bar.close()
        self.stream.close()
        self.logger.close()
        path = last_good_checkpoint(self.run_dir) if self.ranks.main else None
        text = message(err, path, self.run_dir)
        if self.ranks.main:
            try:
                (self.run_dir / "summary.json").write_text(json.dumps(
                    {"status": "failed", "error": str(err), "steps": self.progress.step,
                     "last_good_checkpoint": str(path) if path else None, "export": None}, indent=1))
            except OSError:
                pass  # the disk that failed the save: the error says it all
        return kind(text)

    def _saved_on_failure(self, err: Exception) -> Exception:
        """Stop the target, save the last boundary, and the error to raise (naming the checkpoint).
        Sharded ranks can gather their state only when every rank stopped together (an agreed
        stop); after a failure the newest periodic checkpoint is the saved progress."""
        self.ranks.phase("stopping")
        self.bar.close()
        self.stream.close()
        if self.learner.sharded and isinstance(err, StreamInterrupted):  # before any optimizer step
            self.logger.close()
            return TrainingInterrupted(self.stop.signum or signal.SIGTERM, None)
        if self.learner.sharded and not isinstance(err, TrainingInterrupted):
            found = list_checkpoints(self.run_dir)
            path = self.checkpoint or (found[-1] if found else None)
            self.logger.close()
            saved = (f"progress saved: {path} (sharded state: saved every train.checkpoint_every steps and on "
                     f"SIGTERM)" if path else "no checkpoint yet (sharded state: saved every train.checkpoint_every steps)")
            return type(err)(f"{err}\n{saved} (resume with train.resume=auto train.out_dir={self.run_dir})")
        try:
            path = self.save()
        except (NonFiniteError, WriteFailed) as failed:  # the newest intact checkpoint is the progress
            print(f"{failed}", flush=True)
            path = last_good_checkpoint(self.run_dir) if self.ranks.main else None
        self.logger.close()
        if isinstance(err, (TrainingInterrupted, StreamInterrupted)):
            return TrainingInterrupted(self.stop.signum or signal.SIGTERM, path)
        saved = (f"progress saved: {path}" if path else "no progress to save yet (no optimizer step)" if self.ranks.main
                 else f"rank {self.ranks.rank}: rank 0 saves the progress")
        return type(err)(f"{err}\n{saved} (resume with train.resume=auto train.out_dir={self.run_dir})")

    def _item_tokens(self, item: BatchItem, batch, share: list[int], regenerated) -> int:
        """Tokens of a whole schedule item (every rank's share; regenerating, only the target knew
        them: RegenerationBook.item_tokens, a collective)."""
        if self.regeneration is None:
            return sum(len(self.samples[i].input_ids) for i in item.sample_ids)
        return self.regeneration.item_tokens(item.kind, batch, share, regenerated)

    def _floor_tokens(self, sample_id: int) -> int:
        """Tokens sample `sample_id` streams at least (regenerating: its prompt)."""
        sample = self.samples[sample_id]
        return len(regeneration_prompt(sample) if self.setup.regeneration is not None else sample.input_ids)

    def summarize(self, trainer_written: int, export: Path | None) -> dict:
        job, setup, stream, p = self.job, self.setup, self.stream, self.progress
        train_wall = time.perf_counter() - self._t_train if self._t_train else float("nan")
        elem_bytes = torch.finfo(getattr(torch, job.hw.target_dtype)).bits // 8
        token_bytes = setup.method.streamed_bytes(setup.draft_cfg, elem_bytes)  # its K capture points + the final state
        smallest_batch = min(sum(self._floor_tokens(i) for i in item.sample_ids) for item in self.schedule)
        # summed over the data-parallel ranks: every target process and every trainer (train/disk.py)
        hidden_disk, startup_disk, trainer_written, real, padded = self.ranks.sum_ints(
            [stream.target_io.streaming_write_bytes, stream.target_io.startup_write_bytes, trainer_written,
             *self._positions], self.device)
        summary = {
            "target": job.target.name, "trainer_ranks": self.ranks.world, "steps": p.step,
            "samples_trained": p.samples_trained, "tokens_trained": p.tokens_trained,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "train_wall_s": round(train_wall, 1), "tokens_per_s": round(self._session_tokens / train_wall, 1),
            "stream_wait_frac": round((stream.wait_s - self._wait_at_train_start) / train_wall, 3),
            # of the positions the trainer ranks computed on in this session, the share that was padding
            "padding_share": round(1 - real / padded, 4) if padded else 0.0,
            "total_wall_s": round(time.perf_counter() - self.t_start, 1),
            "eval": self.evals, "data": setup.data.summary(),
            "disk": disk_summary(target_streaming=hidden_disk, target_startup=startup_disk,
                                 trainer_written=trainer_written, checkpoint_bytes=self.artifact_bytes,
                                 answer_bytes=self.regeneration.written_bytes if self.regeneration else 0,
                                 smallest_batch_tokens=smallest_batch, streamed_tokens=self._tokens_streamed,
                                 token_bytes=token_bytes),
            "checkpoint": str(self.checkpoint), "export": str(export),
        }
        if self.regeneration is not None:  # every rank's samples, counted on every rank
            summary["regeneration"] = self.regeneration.log.summary()
            self.logger.table("regenerated", COLUMNS, self.regeneration.log.rows)
        routing = load_counts(self.run_dir) if self.ranks.main else None  # written by the target process at its end
        if routing is not None:
            summary["routing"] = routing.summary()
        if self.ranks.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.logger.summary({"tokens_per_s": summary["tokens_per_s"], "padding_share": summary["padding_share"],
                             **({f"routing/distinct_experts_window{m}_c{c}": v
                                 for m, per_c in summary["routing"]["distinct_per_layer"].items() for c, v in per_c.items()}
                                if routing is not None else {}),
                             **{f"final/{k}": v for k, v in self.evals.get("end", {}).items()}})
        self.logger.close()
        return summary
