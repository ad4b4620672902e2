"""A run's learner as the trainer starts it: a fresh draft (the target's frozen embedding in host
memory, its lm_head, vocab maps from the training split), sharded over co-located ranks as its
method asks, AdamW and the LR schedule.

Built on the host and sharded before anything reaches the device: a co-located rank's GPU only
ever holds its shards and its slice of the target's lm_head, never the whole draft or head, and
`release_cached_memory` hands what the CUDA caching allocator keeps back before the target
starts. SGLang sizes its KV pool from the device's free memory measured in its own process
(sglang `srt/utils/common.py` get_available_gpu_memory: `torch.cuda.mem_get_info`), where blocks
another process's allocator caches count as used; the plan (plan/budget.py `_place_items`)
counts only what the trainer holds then."""
from __future__ import annotations

import torch

from ..config import JobConfig
from .vocab_parallel import VocabShard
from ..setup.run import RunSetup, fresh_draft
from .distributed import Ranks
from .host_embedding import HostEmbedding, keep_embedding_on_host
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
    # on the host, in the seeded order of a CPU run (the same values wherever the run trains)
    draft, lm_head = fresh_draft(setup, job.draft, tr.seed, "cpu", frozen)
    keep_embedding_on_host(draft, frozen)
    opt_device, offloaded = tr.optimizer_device, False
    sharded = ranks is not None and ranks.colocated and ranks.distributed
    if sharded and setup.method.shards_target_head:  # 1/W of the frozen head's rows per rank
        lm_head = VocabShard.of(lm_head, ranks.world, ranks.rank, device=device)
    else:
        lm_head = lm_head.to(device)
    setup.method.attach_target(draft, lm_head)  # a draft that holds the head holds the device's, not the host's
    if sharded:
        units = setup.method.fsdp_units(draft)
        shard_draft(draft, units, bf16=job.hw.autocast == "bf16", keep_gathered=setup.method.keep_units_gathered,
                    offload=opt_device == "cpu", device=device)
        _move_outside(draft, units, device)
        offloaded, opt_device = opt_device == "cpu", None  # the optimizer follows the shards, wherever they are
    else:
        _move_outside(draft, [], device)
    optimizer = build_optimizer(draft.trainable_parameters(), tr.lr, tr.betas, tr.weight_decay, opt_device,
                                offloaded=offloaded, threads=host_threads(job.hw.host_threads_per_rank, job.hw.device))
    scheduler = build_scheduler(optimizer, steps, tr.warmup_ratio, tr.lr_schedule, tr.decay_ratio)
    return DraftLearner(setup.method, draft, lm_head, optimizer, scheduler, spec=job.draft,
                        grad_accum=tr.grad_accum, grad_clip=tr.grad_clip,
                        teacher_chunk=tr.teacher_chunk, autocast_bf16=job.hw.autocast == "bf16",
                        activation_checkpointing=tr.activation_checkpointing, ranks=ranks, seed=tr.seed)


def _move_outside(draft: torch.nn.Module, units: list[str], device: torch.device) -> None:
    """The draft's tensors outside its FSDP units `units` (all of them for []) moved to `device`,
    tensor by tensor (as Module.to, which a fake-tensor trace cannot run: benchmarks/memory_trace.py);
    the units' own are placed by FSDP2 (`shard_draft`), the host embedding stays on the host."""
    inside = {id(m) for name in units for m in draft.get_submodule(name).modules()}
    for module in draft.modules():
        if id(module) in inside or isinstance(module, HostEmbedding):
            continue
        for key, p in module._parameters.items():
            if p is not None and p.device != device:
                module._parameters[key] = torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        for key, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[key] = b.to(device)


def release_cached_memory(device: torch.device) -> None:
    """Hand the blocks the CUDA caching allocator keeps (freed, still reserved) back to the device:
    called before the target starts, so that the free memory SGLang measures is what the plan
    counts the trainer holding (module doc). Nothing to do off CUDA."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
