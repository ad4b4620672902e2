"""One training run, top to bottom:

data -> target (SGLang, own process) -> stream (shared memory) -> draft + TTT loss -> AdamW
-> checkpoints -> serving export -> summary.
"""
from __future__ import annotations

import dataclasses
import json
import hashlib
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from ..config import JobConfig
from ..data.dataset import TokenizedData, build_dataset
from ..draft.model import DraftConfig, Eagle3Draft
from ..plan import check_fits, facts_from_folder, resolve_draft
from ..draft.vocab import build_vocab_maps, count_tokens
from ..export.serving import export_draft
from ..stream.producer import StreamError, StreamInterrupted, TargetStream
from ..target.base import TargetInfo
from ..target.hf_config import load_embedding_and_head, read_target_info
from ..target.layers import (
    DEEPSEEK_RULE,
    default_capture_points,
    layer_id_rule,
    sglang_layer_ids,
    validate_capture_points,
)
from .checkpoint import list_checkpoints, load_checkpoint, read_state, save_checkpoint
from .distributed import RankFailed, Ranks, World, check_layout, launcher_env_hidden, start_ranks, stop_ranks
from .metrics import MetricsLogger, NullLogger, TTTStats
from .optim import build_optimizer, build_scheduler
from .step import DraftTrainer


# ----------------------------------------------------------------------------------- setup
@dataclass
class RunSetup:
    model_path: str
    info: TargetInfo
    capture_points: list[int]
    eagle_layer_ids: list[int]
    tokenizer: object
    data: TokenizedData
    draft_cfg: DraftConfig


def resolve_target_path(job: JobConfig) -> str:
    from ..target import models

    if job.target.path:
        if not Path(job.target.path, "config.json").is_file():
            raise FileNotFoundError(f"target.path={job.target.path}: not an HF model folder (no config.json)")
        return job.target.path
    if job.target.builtin == "smollm2":
        return str(models.smollm2_path())
    if job.target.builtin == "tiny_deepseek":
        return str(models.tiny_deepseek_path(models.smollm2_path(), job.target.tiny_layers, job.target.tiny_hidden))
    if job.target.builtin == "tiny_kimi":
        return str(models.tiny_kimi_k25_path(models.smollm2_path(), job.target.tiny_layers, job.target.tiny_hidden))
    raise ValueError(f"target.builtin={job.target.builtin!r}: expected smollm2, tiny_deepseek or tiny_kimi (or set target.path)")


def prepare(job: JobConfig) -> RunSetup:
    """Everything decided before any process starts; bad config fails here."""
    from transformers import AutoTokenizer

    check_layout(job.hw, World.from_env())  # torchrun ranks per node == target replicas of the hw profile
    model_path = resolve_target_path(job)
    info = read_target_info(model_path)
    facts = facts_from_folder(model_path, job.target.name)
    check_fits(job, facts)  # memory plan (GPU profiles): refuses with the override that would fit
    if layer_id_rule(info.architecture) == DEEPSEEK_RULE and job.hw.device == "cpu":  # DeepSeek-V2/V3, Kimi-K2.5
        from transformers import AutoConfig

        from ..target.sglang_cpu_compat import check_deepseek_config

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=job.target.trust_remote_code)
        check_deepseek_config(getattr(config, "text_config", None) or config)
    points = validate_capture_points(job.target.aux_layers or default_capture_points(info.num_layers), info.num_layers)
    eagle_ids = sglang_layer_ids(points, layer_id_rule(info.architecture))
    if job.data.max_length > info.max_position_embeddings:
        raise ValueError(f"data.max_length={job.data.max_length} exceeds the target's context "
                         f"({info.max_position_embeddings}); lower data.max_length")
    if job.data.max_length > job.hw.max_total_tokens:
        raise ValueError(f"data.max_length={job.data.max_length} exceeds hw.max_total_tokens={job.hw.max_total_tokens}")
    if job.draft.vocab_size > info.vocab_size:
        raise ValueError(f"draft.vocab_size={job.draft.vocab_size} exceeds the target vocab {info.vocab_size}")
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=job.target.trust_remote_code)
    eot = job.target.end_of_turn_token
    end_of_turn_id = tokenizer.convert_tokens_to_ids(eot) if eot else tokenizer.eos_token_id
    if end_of_turn_id is None or end_of_turn_id == tokenizer.unk_token_id:
        raise ValueError(f"target.end_of_turn_token={eot!r} is not a token of this tokenizer")
    if job.target.chat_format == "kimi":
        from ..data.kimi_format import kimi_renderer

        render = kimi_renderer(tokenizer, mode=job.target.chat_mode)
    elif job.target.chat_format == "template":
        render = None
    else:
        raise ValueError(f"target.chat_format={job.target.chat_format!r}: expected template or kimi")
    data = build_dataset(
        tokenizer, source=job.data.source, path=job.data.path, max_length=job.data.max_length,
        num_samples=job.data.num_samples, heldout_samples=job.data.heldout_samples, end_of_turn_id=end_of_turn_id,
        seed=job.data.seed, split=job.data.split, show_progress=job.train.progress, render=render,
    )
    top = max((int(s.input_ids.max()) for s in [*data.train, *data.heldout] if len(s.input_ids)), default=-1)
    if top >= info.vocab_size:  # the engine would index past its embedding
        raise ValueError(f"the tokenizer produced token id {top}, outside the target's vocab ({info.vocab_size}): "
                         f"tokenizer and target weights in {model_path} do not match")
    draft_cfg = resolve_draft(job.draft, facts)
    return RunSetup(model_path, info, points, eagle_ids, tokenizer, data, draft_cfg)


# ------------------------------------------------------------------------------------ plan
@dataclass
class PlanItem:
    kind: str  # "train" | "eval"
    sample_ids: list[int]
    tag: str = ""  # eval: which evaluation ("start", "step_40", "end")


def build_plan(n_train: int, n_heldout: int, *, batch_size: int, grad_accum: int, epochs: int,
               max_steps: int | None, eval_every: int | None, seed: int) -> tuple[list[PlanItem], int]:
    """Order of target batches: eval(start), train micro-batches with evals interleaved, eval(end).

    Held-out sample ids are n_train..n_train+n_heldout-1. Returns (plan, optimizer steps).
    """
    rng = random.Random(seed)
    micro = []
    for _ in range(epochs):
        order = list(range(n_train))
        rng.shuffle(order)
        micro += [order[i:i + batch_size] for i in range(0, n_train, batch_size)]
    steps = len(micro) // grad_accum
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps < 1:
        raise ValueError(f"{n_train} samples make no optimizer step with batch_size={batch_size} x grad_accum={grad_accum}")
    micro = micro[: steps * grad_accum]
    held = list(range(n_train, n_train + n_heldout))
    eval_batches = [held[i:i + batch_size] for i in range(0, n_heldout, batch_size)]

    def evals(tag):
        return [PlanItem("eval", b, tag) for b in eval_batches]

    plan = evals("start")
    for step in range(steps):
        plan += [PlanItem("train", b) for b in micro[step * grad_accum:(step + 1) * grad_accum]]
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            plan += evals(f"step_{step + 1}")
    plan += evals("end")
    return plan, steps


# ---------------------------------------------------------------------------------- helpers
def _allocated_bytes(path: Path) -> int:
    """Bytes a folder occupies on disk (allocated blocks of its files and directories): what a
    process's write_bytes counter charges for writing it, page rounding included."""
    path = Path(path)
    return sum(p.stat().st_blocks * 512 for p in [path, *path.rglob("*")]) if path.exists() else 0


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def print_plan(job: JobConfig, setup: RunSetup, plan: list[PlanItem], steps: int, draft: Eagle3Draft, run_dir: Path,
               world: int = 1):
    trainable = sum(p.numel() for p in draft.trainable_parameters())
    n_train_items = sum(1 for p in plan if p.kind == "train")
    train_tokens = sum(len(setup.data.train[i].input_ids) for p in plan if p.kind == "train" for i in p.sample_ids
                       if i < len(setup.data.train))
    H = setup.info.hidden_size
    lines = [
        "== specforge_k25 run plan ==",
        f"target      {job.target.name}: {setup.info.architecture}, {setup.info.num_layers} layers, hidden {H}, "
        f"vocab {setup.info.vocab_size} ({setup.model_path})",
        f"engine      SGLang in its own process, device {job.hw.device}, TP {job.hw.target_tp}, {job.hw.target_dtype}",
        f"aux layers  inputs of layers {setup.capture_points} (SGLang eagle3 ids {setup.eagle_layer_ids})",
        f"draft       1 layer, H {H}, heads {setup.draft_cfg.num_attention_heads}/{setup.draft_cfg.num_key_value_heads}, "
        f"I {setup.draft_cfg.intermediate_size}, Vd {setup.draft_cfg.draft_vocab_size}; {_fmt_params(trainable)} trainable "
        f"(+{_fmt_params(draft.embed_tokens.weight.numel())} frozen embedding)",
        f"data        {len(setup.data.train)} train / {len(setup.data.heldout)} held-out samples, max_length "
        f"{job.data.max_length}; skipped {dict(setup.data.skipped) or 'none'}",
        f"schedule    {steps} optimizer steps = {n_train_items} micro-batches of {job.train.batch_size} "
        f"x accum {job.train.grad_accum}, {train_tokens} tokens; TTT K={job.train.ttt_length}; lr {job.train.lr}",
        f"stream      {job.train.stream_slots} shared-memory slots of up to "
        f"{job.train.batch_size * job.data.max_length} tokens x {4 * H} floats",
        f"outputs     {run_dir}",
    ]
    if world > 1:
        lines.insert(-2, f"ranks       {world} data-parallel trainer ranks, one target replica each; global batch "
                         f"{world} x {job.train.batch_size} samples, sliced by rank")
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------------- builders
def fresh_draft(setup: RunSetup, seed: int) -> tuple[Eagle3Draft, torch.Tensor]:
    """An untrained draft (seeded init, the target's embedding, vocab maps from the training
    split only) and the target's lm_head [V, Ht]."""
    torch.manual_seed(seed)
    d2t, t2d = build_vocab_maps(count_tokens(setup.data.train, setup.info.vocab_size), setup.draft_cfg.draft_vocab_size)
    embed, lm_head = load_embedding_and_head(setup.model_path)
    draft = Eagle3Draft(setup.draft_cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed.float())
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft, lm_head


def build_trainer(job: JobConfig, setup: RunSetup, steps: int, device: torch.device,
                  ranks: Ranks | None = None) -> DraftTrainer:
    """A fresh draft (target embedding, vocab maps from the training split only), AdamW and schedule."""
    tr = job.train
    draft, lm_head = fresh_draft(setup, tr.seed)
    frozen = getattr(torch, job.hw.target_dtype)  # the frozen embedding / lm_head keep the target's dtype
    draft.embed_tokens.to(frozen)
    draft.to(device)
    optimizer = build_optimizer(draft.trainable_parameters(), tr.lr, tr.betas, tr.weight_decay, tr.optimizer_device)
    scheduler = build_scheduler(optimizer, steps, tr.warmup_ratio)
    return DraftTrainer(draft, lm_head.to(device, frozen), optimizer, scheduler, ttt_length=tr.ttt_length,
                        loss_decay=tr.loss_decay, grad_accum=tr.grad_accum, grad_clip=tr.grad_clip,
                        teacher_chunk=tr.teacher_chunk, autocast_bf16=job.hw.autocast == "bf16",
                        activation_checkpointing=tr.activation_checkpointing, ranks=ranks)


def make_target_stream(job: JobConfig, setup: RunSetup, samples, plan: list[list[int]],
                       engine: str = "sglang") -> TargetStream:
    """The target process over `plan` (lists of indices into `samples`), not yet started."""
    from ..stream.producer import target_spec  # the same spec as the nodes that only run TP ranks

    spec = target_spec(job, setup.model_path, setup.info.architecture, setup.capture_points, engine)
    return TargetStream(spec, [s.input_ids for s in samples], plan, hidden_size=setup.info.hidden_size,
                        slots=job.train.stream_slots, timeout_s=job.train.stream_timeout_s,
                        start_timeout_s=job.train.engine_start_timeout_s,
                        dtype=getattr(torch, job.hw.target_dtype),
                        device="cpu" if job.hw.device == "cpu" else f"cuda:{job.hw.target_gpu}")


# ------------------------------------------------------------------------------------- run
class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT: a checkpoint was saved and the target stopped."""

    def __init__(self, signum: int, checkpoint: Path | None):
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint: {checkpoint}")
        self.signum, self.checkpoint = signum, checkpoint


class _StopOnSignal:
    """Turns the first SIGTERM/SIGINT into a flag checked at safe points; a second one acts as usual."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        return self.signum is not None


def run_fingerprint(job: JobConfig, setup: RunSetup, n_plan: int, ranks: int = 1) -> dict:
    """What a checkpoint must agree with to be resumed: target, draft shape, data, schedule
    (and the number of data-parallel ranks when there are several)."""
    digest = hashlib.sha1()
    for s in setup.data.train:
        digest.update(s.input_ids.numpy().tobytes())
        digest.update(s.loss_mask.numpy().tobytes())
    return {
        "target_architecture": setup.info.architecture, "target_layers": setup.info.num_layers,
        "target_hidden": setup.info.hidden_size, "target_vocab": setup.info.vocab_size,
        "capture_points": list(setup.capture_points), "draft": dataclasses.asdict(setup.draft_cfg),
        "train_data_sha1": digest.hexdigest(), "plan_items": n_plan, "seed": job.train.seed,
        "batch_size": job.train.batch_size, "grad_accum": job.train.grad_accum, "ttt_length": job.train.ttt_length,
        **({"trainer_ranks": ranks} if ranks > 1 else {}),
    }


def find_resume_checkpoint(resume: str, run_dir: Path) -> Path | None:
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"train.resume={resume}: not a checkpoint folder (no state.json)")
    return path


def check_fingerprint(saved: dict, current: dict, checkpoint: Path) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"cannot resume from {checkpoint}: it belongs to a different run\n  " + "\n  ".join(diffs))


def run_training(job: JobConfig, run_dir: str | Path, engine: str = "sglang") -> dict:
    """Train a draft online and export it. Returns the summary (also written to summary.json).

    Raises TrainingInterrupted (after saving) on SIGTERM/SIGINT, and StreamError (after saving)
    when the target process fails, dies or stalls. Under torchrun every rank calls this
    (train/distributed.py); only rank 0 prints, logs, checkpoints and exports, and a rank that
    sees another one fail raises RankFailed (rank 0 after saving).
    """
    try:
        return _run_training(job, run_dir, engine)
    finally:
        stop_ranks()


def _local_items(stream: TargetStream, shares: list[list[int]]):
    """(share, (msg, aux, final) or None) per plan item: a rank without a share of an item reads
    nothing from its stream for it."""
    batches = iter(stream)
    for share in shares:
        yield share, (next(batches) if share else None)
    next(batches, None)  # runs the stream to the target's end message (its I/O counters)


def _run_training(job: JobConfig, run_dir: str | Path, engine: str) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tr = job.train
    torch.manual_seed(tr.seed)
    if job.hw.device == "cpu":
        torch.set_num_threads(job.hw.trainer_threads)
    setup = prepare(job)
    job, ranks = start_ranks(job)  # torchrun: this rank's trainer GPU and target replica, the process group
    run_dir = Path(ranks.from_main(str(run_dir)))  # Hydra's default folder is a timestamp: take rank 0's
    device = torch.device("cuda", job.hw.trainer_gpu) if job.hw.device == "cuda" else torch.device("cpu")

    # The plan is over GLOBAL batches (train.batch_size per rank x ranks); rank r trains on slice r of each.
    plan, steps = build_plan(len(setup.data.train), len(setup.data.heldout), batch_size=tr.batch_size * ranks.world,
                             grad_accum=tr.grad_accum, epochs=tr.epochs, max_steps=tr.max_steps,
                             eval_every=tr.eval_every, seed=tr.seed)
    trainer = build_trainer(job, setup, steps, device, ranks)
    draft, optimizer, scheduler = trainer.draft, trainer.optimizer, trainer.scheduler
    fingerprint = run_fingerprint(job, setup, len(plan), ranks.world)
    # progress at the last optimizer-step boundary: what a checkpoint records and a resume restores
    boundary = {"step": 0, "micro_batches": 0, "plan_item": 0, "tokens_trained": 0, "samples_trained": 0}
    evals: dict[str, dict] = {}
    resume_from = find_resume_checkpoint(tr.resume, run_dir)
    if resume_from is not None:
        check_fingerprint(read_state(resume_from).get("fingerprint", {}), fingerprint, resume_from)
        state = load_checkpoint(resume_from, draft, optimizer, scheduler)  # weights, Adam, LR, RNG, vocab maps
        boundary = {k: state[k] for k in boundary}
        evals = state.get("evals", {})
        if ranks.main:
            print(f"resuming from {resume_from} at optimizer step {boundary['step']} (plan item {boundary['plan_item']})")
    ranks.check_same(boundary["plan_item"], "the plan item to resume from", device)
    start_item = boundary["plan_item"]
    if ranks.main:
        print_plan(job, setup, plan, steps, draft, run_dir, ranks.world)
        logger = MetricsLogger(tr.logger, project=tr.wandb_project, mode=tr.wandb_mode, run_dir=str(run_dir),
                               config={"job": dataclasses.asdict(job), "capture_points": setup.capture_points})
    else:
        logger = NullLogger()
    samples = setup.data.train + setup.data.heldout
    stop = _StopOnSignal()
    shares = [ranks.share(p.sample_ids, tr.batch_size) for p in plan[start_item:]]  # this rank's slices
    stream = make_target_stream(job, setup, samples, [ids for ids in shares if ids], engine)
    stream.should_stop = stop.requested
    eval_stats: TTTStats | None = None
    train_stats = TTTStats()
    step, micro = boundary["step"], boundary["micro_batches"]
    tokens_trained, samples_trained = boundary["tokens_trained"], boundary["samples_trained"]
    session_tokens = tokens_streamed = 0
    ckpt_path = None
    artifact_bytes = 0  # bytes of checkpoints and export the trainer wrote (to separate them from anything else)
    bar = tqdm(total=steps, initial=step, desc="train", unit="step", disable=not (tr.progress and ranks.main),
               dynamic_ncols=True)
    t_train = None  # set at the first training batch: throughput excludes engine start and the first eval
    wait_at_train_start = 0.0
    io = psutil.Process().io_counters

    def say(line: str) -> None:
        if ranks.main:
            bar.write(line)

    def save(plan_item_done: bool = False) -> Path | None:
        """Checkpoint at the last optimizer-step boundary (rank 0 only; the ranks' weights are equal)."""
        nonlocal ckpt_path, artifact_bytes
        if not ranks.main:
            return None
        extra = {**boundary, "evals": evals, "fingerprint": fingerprint}
        if plan_item_done:
            extra["plan_item"] = len(plan)
        ckpt_path = save_checkpoint(run_dir, boundary["step"], draft, optimizer, scheduler, extra, tr.keep_checkpoints)
        artifact_bytes += _allocated_bytes(ckpt_path)
        return ckpt_path

    try:
        with stop, launcher_env_hidden(), stream:  # the target process must not inherit torchrun's variables
            trainer_io_start = io().write_bytes
            # Every rank walks the whole plan (the collectives line up); it reads its stream only for
            # the items it has a share of. Token and sample counts are the global items'.
            for index, (share, got) in enumerate(_local_items(stream, shares), start_item):
                item = plan[index]
                batch = None
                if got is not None:
                    msg, aux_packed, final_packed = got
                    batch = trainer.make_batch([samples[i] for i in share], msg.lengths, aux_packed, final_packed)
                    stream.release(msg)  # the slot is free for the target's next batch
                item_tokens = sum(len(samples[i].input_ids) for i in item.sample_ids)
                tokens_streamed += item_tokens
                if stop.requested():
                    raise TrainingInterrupted(stop.signum, None)
                if item.kind == "eval":
                    eval_stats = eval_stats or TTTStats()
                    if batch is not None:
                        eval_stats.add(trainer.evaluate(batch))
                    continue
                if eval_stats is not None:  # an evaluation just ended
                    tag = _finish_eval(evals, trainer.sum_stats(eval_stats), plan, index, logger, step)
                    eval_stats = None
                    say(f"eval[{tag}] " + _eval_line(evals[tag], tr.ttt_length))

                if t_train is None:
                    t_train, wait_at_train_start = time.perf_counter(), stream.wait_s
                res = trainer.train_micro(batch)  # None: no share of this micro-batch (it still joins the counts)
                if res is not None:
                    train_stats.add(res)
                micro += 1
                tokens_trained += item_tokens
                session_tokens += item_tokens
                samples_trained += len(item.sample_ids)
                if micro % tr.grad_accum:
                    continue
                grad_norm = trainer.optimizer_step()
                step += 1
                boundary = {"step": step, "micro_batches": micro, "plan_item": index + 1,
                            "tokens_trained": tokens_trained, "samples_trained": samples_trained}
                elapsed = time.perf_counter() - t_train
                loss = trainer.loss_value(res)
                log_now = step % tr.log_every == 0 or step == steps
                if log_now:
                    trainer.sum_stats(train_stats)
                summary = train_stats.summary("train")
                bar.set_postfix(tok_s=f"{session_tokens / elapsed:.0f}", loss=f"{loss:.3f}",
                                acc0=f"{summary.get('train/acc_0', 0):.2f}", q=stream.depth())
                bar.update(1)
                if log_now:
                    logger.log({**summary, "train/loss": loss, "train/grad_norm": grad_norm,
                                "train/lr": scheduler.get_last_lr()[0], "perf/tokens_per_s": session_tokens / elapsed,
                                "stream/depth": stream.depth(), "stream/wait_frac": stream.wait_s / elapsed}, step)
                    train_stats = TTTStats()
                if tr.checkpoint_every and step % tr.checkpoint_every == 0 and step < steps:
                    save()
            if eval_stats is not None:
                tag = _finish_eval(evals, trainer.sum_stats(eval_stats), plan, len(plan) - 1, logger, step)
                say(f"eval[{tag}] " + _eval_line(evals[tag], tr.ttt_length))
            trainer_written = io().write_bytes - trainer_io_start
        bar.close()
        save(plan_item_done=True)
        export_dir = (export_draft(draft.cpu(), run_dir / "export", setup.eagle_layer_ids,
                                   setup.info.bos_token_id, setup.info.eos_token_id,
                                   capture_points=setup.capture_points) if ranks.main else None)
    except (TrainingInterrupted, StreamInterrupted):
        bar.close()
        stream.close()
        path = save()
        logger.close()
        raise TrainingInterrupted(stop.signum or signal.SIGTERM, path) from None
    except (StreamError, RankFailed) as err:
        bar.close()
        stream.close()
        path = save()
        logger.close()
        saved = f"progress saved: {path}" if path else f"rank {ranks.rank}: rank 0 saves the progress"
        raise type(err)(f"{err}\n{saved} (resume with train.resume=auto train.out_dir={run_dir})") from None
    finally:
        bar.close()
        stream.close()
    train_wall = time.perf_counter() - t_train if t_train else float("nan")
    wait_frac = (stream.wait_s - wait_at_train_start) / train_wall
    elem_bytes = torch.finfo(getattr(torch, job.hw.target_dtype)).bits // 8
    smallest_batch = min(sum(len(samples[i].input_ids) for i in p.sample_ids) for p in plan)
    # summed over the data-parallel ranks: every target process and every trainer
    hidden_disk, startup_disk, trainer_written = ranks.sum_ints(
        [stream.target_io.streaming_write_bytes, stream.target_io.startup_write_bytes, trainer_written], device)
    summary = {
        "target": job.target.name, "trainer_ranks": ranks.world, "steps": step, "samples_trained": samples_trained, "tokens_trained": tokens_trained,
        "resumed_from": str(resume_from) if resume_from else None,
        "train_wall_s": round(train_wall, 1), "tokens_per_s": round(session_tokens / train_wall, 1),
        "stream_wait_frac": round(wait_frac, 3), "total_wall_s": round(time.perf_counter() - t_start, 1),
        "eval": evals, "data": setup.data.summary(),
        # Measured from the processes' I/O counters (/proc/<pid>/io write_bytes) over the streaming
        # phase (first to last batch); shared memory is tmpfs and does not count. The target
        # process produces every hidden state, so its count is the hidden-state bytes on disk.
        # The trainer's writes other than checkpoint files (filesystem metadata, temp probes) are
        # shown beside the smallest batch of hidden states: a spilled batch could not hide below it.
        "disk": {"hidden_state_bytes_on_disk": hidden_disk,
                 "target_startup_write_bytes": startup_disk,
                 "trainer_checkpoint_bytes": artifact_bytes,
                 "trainer_other_write_bytes": max(0, trainer_written - artifact_bytes),
                 "smallest_batch_hidden_state_bytes": smallest_batch * 4 * setup.info.hidden_size * elem_bytes,
                 "hidden_state_bytes_streamed_in_memory": tokens_streamed * 4 * setup.info.hidden_size * elem_bytes},
        "checkpoint": str(ckpt_path), "export": str(export_dir),
    }
    if ranks.main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.summary({"tokens_per_s": summary["tokens_per_s"], **{f"final/{k}": v for k, v in evals.get("end", {}).items()}})
    logger.close()
    return summary


def _finish_eval(evals, stats: TTTStats, plan, last_item: int, logger, step: int) -> str:
    tag = next(p.tag for p in reversed(plan[: last_item + 1]) if p.kind == "eval")
    evals[tag] = {k.split("/", 1)[1]: v for k, v in stats.summary("eval").items()}
    logger.log({f"eval/{k}": v for k, v in evals[tag].items()}, step)
    return tag


def _eval_line(ev: dict, K: int) -> str:
    accs = " ".join(f"{ev[f'acc_{k}']:.3f}" for k in range(K))
    return f"tau_sim {ev['tau_sim']:.3f}  acc_0..{K - 1} [{accs}]  positions {int(ev['positions'])}"
