"""A run's learner as the trainer starts it: a fresh draft (the target's frozen embedding in host
memory, its lm_head, vocab maps from the training split), sharded over co-located ranks as its
method asks, AdamW and the LR schedule."""
from __future__ import annotations

import torch

from ..config import JobConfig
from .vocab_parallel import VocabShard
from ..setup.run import RunSetup, fresh_draft
from .distributed import Ranks
from .host_embedding import keep_embedding_on_host
from .optim import build_optimizer, build_scheduler, host_threads
from .sharding import shard_draft
from .step import DraftLearner


def build_learner(job: JobConfig, setup: RunSetup, steps: int, device: torch.device,
                  ranks: Ranks | None = None) -> DraftLearner:
    """A fresh draft (target embedding, vocab maps from the training split only), AdamW and schedule.
    hw.trainer_layout=colocated with several ranks: the draft sharded over them (train/sharding.py),
    AdamW on each rank's shard, on the GPU or with train.optimizer_device=cpu on the host (FSDP2's
    CPU offload), and for a method that scores tokens over the target's vocabulary
    (`shards_target_head`) 1/W of the frozen lm_head's rows per rank. The frozen embedding stays
    on the host (train/host_embedding.py)."""
    tr = job.train
    frozen = getattr(torch, job.hw.target_dtype)  # the frozen embedding / lm_head keep the target's dtype
    # the lm_head made on the trainer's device: a draft that holds it moves no copy of it with draft.to
    draft, lm_head = fresh_draft(setup, job.draft, tr.seed, device, frozen)
    draft.embed_tokens.to(frozen)
    keep_embedding_on_host(draft)
    draft.to(device)
    opt_device, offloaded = tr.optimizer_device, False
    if ranks is not None and ranks.colocated and ranks.distributed:
        shard_draft(draft, setup.method.fsdp_units(draft), bf16=job.hw.autocast == "bf16",
                    keep_gathered=setup.method.keep_units_gathered, offload=opt_device == "cpu")
        offloaded, opt_device = opt_device == "cpu", None  # the optimizer follows the shards, wherever they are
        if setup.method.shards_target_head:  # 1/W of the frozen head per rank (the whole one is freed)
            lm_head = VocabShard.of(lm_head, ranks.world, ranks.rank)
    optimizer = build_optimizer(draft.trainable_parameters(), tr.lr, tr.betas, tr.weight_decay, opt_device,
                                offloaded=offloaded, threads=host_threads(job.hw.host_threads_per_rank, job.hw.device))
    scheduler = build_scheduler(optimizer, steps, tr.warmup_ratio, tr.lr_schedule, tr.decay_ratio)
    return DraftLearner(setup.method, draft, lm_head, optimizer, scheduler, spec=job.draft,
                        grad_accum=tr.grad_accum, grad_clip=tr.grad_clip,
                        teacher_chunk=tr.teacher_chunk, autocast_bf16=job.hw.autocast == "bf16",
                        activation_checkpointing=tr.activation_checkpointing, ranks=ranks, seed=tr.seed)
