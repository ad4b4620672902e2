"""The learner of a run: `DraftLearner` (one micro-batch of draft training or evaluation from packed
target hidden states, the optimizer step, the state a checkpoint holds) and `build_learner`, which
starts it: a fresh draft (the target's frozen embedding in host memory, its lm_head, vocab maps
from the training split), sharded over co-located ranks as its method asks, AdamW and the LR
schedule.

Built on the host and sharded before anything reaches the device: a co-located rank's GPU only
ever holds its shards and its slice of the target's lm_head, never the whole draft or head, and
`release_cached_memory` hands what the CUDA caching allocator keeps back before the target
starts. SGLang sizes its KV pool from the device's free memory measured in its own process
(sglang `srt/utils/common.py` get_available_gpu_memory: `torch.cuda.mem_get_info`), where blocks
another process's allocator caches count as used; the plan (plan/budget.py `_place_items`)
counts only what the trainer holds then."""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from ..config import JobConfig
from ..draft.objective import LossResult, compute_teacher
from ..draft.method import DraftBatch, DraftMethod, draft_state
from ..setup.run import RunSetup, fresh_draft
from ..stream.ring import SeqWindow
from .context_parallel import SeqShard, shard_of
from .distributed import Ranks
from .host_embedding import HostEmbedding, keep_embedding_on_host
from .metrics import LossStats
from .optim import build_optimizer, build_scheduler, host_threads
from .sharding import (full_model_state, full_state, is_sharded, load_full_state, reshard, shard_draft,
                       unsharded_copy)
from .vocab_parallel import VocabShard


def pad_packed(packed: torch.Tensor, lengths: list[int], start: int = 0, length: int | None = None) -> torch.Tensor:
    """packed [sum(lengths), D] -> [B, length, D]: positions [start, start + length) of every
    sequence (default: all of them, length max(lengths)), zero past a sequence's end."""
    length = max(lengths) - start if length is None else length
    out = packed.new_zeros(len(lengths), length, packed.shape[-1])
    offset = 0
    for b, n in enumerate(lengths):
        part = packed[offset + start:offset + min(n, start + length)]  # empty past the sequence's end
        out[b, :part.shape[0]] = part
        offset += n
    return out


def batch_seed(*key) -> int:
    """The seed of a batch's random draws (DraftMethod.prepare_batch: DFlash's anchors) from a key
    naming the batch (train/trainer.py: train.seed, the schedule item, its samples): the draws
    depend on nothing else, so a resume from the data cursor draws what an uninterrupted run did
    without any generator state in the checkpoint."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") & (2 ** 63 - 1)


class DraftLearner:
    """Owns the draft, the frozen target lm_head (in the target's dtype; co-located, for a method
    with `shards_target_head`, this rank's VocabShard of its rows), the optimizer and the schedule.

    The method decides what a batch holds and how many positions its loss counts per token
    (`depth`: EAGLE-3's TTT unroll draft.ttt_length, DFlash's block size - 1): the teacher only
    when the method reads it (`needs_teacher`), its random draws from the learner's generator
    (`prepare_batch`, seeded per batch by the caller: `batch_seed`), and the target's lm_head when
    the model computes with it (`attach_target`).

    With data-parallel `ranks` (train/distributed.py) each rank trains on its slice of every
    micro-batch: the loss is divided by the micro-batch's loss positions summed over all ranks and
    the gradients are summed over ranks before clipping, so the update equals one rank's on the
    whole global micro-batch. A draft sharded with FSDP2 (train/sharding.py, the co-located layout)
    has its gradients summed by FSDP's reduce-scatter, and a rank without a share still runs a
    loss-free one-position batch: every rank takes part in the same collectives.

    With context parallelism (`ranks.cp` > 1, train/context_parallel.py) the ranks of a group get
    the same sequences and each keeps its window of their positions: the aux states of its L
    positions and the teacher of those and the `depth` after them (what the loss's shifts read),
    never the whole sequence's [T, Vd] teacher.

    The collectives torch runs inside a step (FSDP2's, DTensor's) raise RankFailed naming the step
    when a peer is gone (`Ranks.collectives`), as the ones the learner calls do.
    """

    def __init__(self, method: DraftMethod, draft: torch.nn.Module, lm_head: torch.Tensor | VocabShard, optimizer,
                 scheduler, *, spec,
                 grad_accum: int, grad_clip: float, teacher_chunk: int, autocast_bf16: bool,
                 activation_checkpointing: bool = False, ranks: Ranks | None = None, seed: int = 0):
        """`spec`: the method's draft.* config (its objective's settings: EAGLE-3's TTT unroll and weights)."""
        self.method, self.draft, self.lm_head, self.optimizer, self.scheduler = method, draft, lm_head, optimizer, scheduler
        self.ranks = ranks or Ranks()
        self.spec, self.grad_accum = spec, grad_accum
        self.depth = method.depth(spec, draft.cfg)  # positions the loss counts per token (LossResult's length)
        self.generator = torch.Generator().manual_seed(seed)  # the batches' random draws (CPU)
        method.attach_target(draft, lm_head)
        self.grad_clip, self.teacher_chunk = grad_clip, teacher_chunk
        self.activation_checkpointing = activation_checkpointing
        self.device = lm_head.device
        self.sharded = is_sharded(draft, method.fsdp_units(draft))
        self.aux_width = method.num_aux(draft.cfg) * draft.cfg.target_hidden_size  # K*Ht
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast_bf16)

    def make_batch(self, samples, lengths: list[int], aux_packed: torch.Tensor, final_packed: torch.Tensor,
                   seeds: list[int] | None = None) -> DraftBatch:
        """samples: the `Sample`s of the batch, in stream order; the packed tensors may be views
        into shared memory: everything kept is copied, so the slot can be released afterwards.
        seeds: one per sample (`batch_seed` of the item and the sample): the method's random draws
        per sequence (DraftBatch.seeds); None draws on from the learner's generator.
        With context parallelism the packed tensors hold each sequence's SeqWindow rows only
        (stream/ring.py), `lengths` their counts; the sequences' own lengths are the samples'."""
        dev = self.device
        if aux_packed.shape[-1] != self.aux_width:
            raise ValueError(f"the stream's aux states are {aux_packed.shape[-1]} wide, the draft reads "
                             f"{self.aux_width} (target.aux_layers and the draft disagree on K)")
        pad = torch.nn.utils.rnn.pad_sequence
        rows = lengths
        if self.ranks.cp > 1:
            lengths = [len(s.input_ids) for s in samples]
            expected = [e - a for a, e in self.window().spans(lengths)]
            if list(rows) != expected:  # the target wrote another window than this rank computes on
                raise ValueError(f"context parallelism: the stream carries {list(rows)} rows of the sequences "
                                 f"(lengths {lengths}), rank {self.ranks.cp_rank} of {self.ranks.cp} expects {expected}")
        batch = self._assemble(pad([s.input_ids for s in samples], batch_first=True, padding_value=0),
                               pad([s.loss_mask for s in samples], batch_first=True, padding_value=False),
                               lengths, aux_packed, final_packed, rows)
        if aux_packed.is_cuda:  # CUDA copies are asynchronous: finish them before the caller hands the slot back
            torch.cuda.current_stream(aux_packed.device).synchronize()
            torch.cuda.current_stream(dev).synchronize()
        if seeds is not None:
            if len(seeds) != len(samples):
                raise ValueError(f"{len(seeds)} seeds for a batch of {len(samples)} sequences")
            batch.seeds = list(seeds)
        return self.method.prepare_batch(self.draft.cfg, batch, self.generator)

    def _assemble(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: list[int], aux_packed: torch.Tensor,
                  final_packed: torch.Tensor, rows: list[int]) -> DraftBatch:
        """The DraftBatch of right-padded ids / masks [B, max(lengths)] and the packed states (`rows`
        per sequence: all positions, or with context parallelism this rank's window and its halo)."""
        dev, T = self.device, max(lengths)
        seq = self.shard(lengths)
        length, halo = T, 0
        if seq is not None:  # the packed rows start at the window
            length, halo = seq.length, min(self.depth, seq.padded_length - seq.start - seq.length)
            input_ids, loss_mask = (F.pad(t, (0, seq.padded_length - T)) for t in (input_ids, loss_mask))
        aux = pad_packed(aux_packed, rows, 0, length).to(dev, torch.float32)
        teacher = final = None
        if self.method.needs_teacher or self.method.needs_final_hidden:  # the window and the `depth` positions its shifts read
            final = pad_packed(final_packed, rows, 0, length + halo).to(dev, torch.float32)
        if self.method.needs_teacher:
            teacher = compute_teacher(final, self.lm_head, self.draft.d2t, self.teacher_chunk)
        return DraftBatch(input_ids.to(dev), loss_mask.to(dev), torch.tensor(lengths, device=dev), aux, teacher,
                          seq=seq, final_hidden=final if self.method.needs_final_hidden else None)

    def shard(self, lengths: list[int]) -> SeqShard | None:
        """This rank's window of a batch of sequences of `lengths` (None: no context parallelism)."""
        r = self.ranks
        return shard_of(lengths, r.cp_group, r.cp_rank, r.cp) if r.cp > 1 else None

    def window(self) -> SeqWindow:
        """The rows of each sequence this rank's stream carries under context parallelism."""
        return SeqWindow(self.ranks.cp_rank, self.ranks.cp, self.depth)

    def empty_batch(self) -> DraftBatch:
        """One position, no loss position: a sharded rank's stand-in for a batch it has no share of."""
        ht = self.draft.cfg.target_hidden_size
        rows = [e - a for a, e in self.window().spans([1])] if self.ranks.cp > 1 else [1]
        batch = self._assemble(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.bool), [1],
                               torch.zeros(sum(rows), self.aux_width), torch.zeros(sum(rows), ht), rows)
        return self.method.prepare_batch(self.draft.cfg, batch, torch.Generator().manual_seed(0))  # draws nothing counted

    def _loss(self, batch: DraftBatch, normalizer: torch.Tensor | None = None) -> LossResult:
        with self.autocast():
            return self.method.loss(self.draft, batch, self.spec, depth=self.depth, normalizer=normalizer,
                                    checkpoint=self.activation_checkpointing)

    def train_micro(self, batch: DraftBatch | None) -> LossResult | None:
        """Forward + backward of this rank's part of a micro-batch. None: this rank has no sample in
        it (a short last batch); it still takes part in the count all-reduce."""
        normalizer = None
        if self.ranks.distributed:
            local = (self.method.loss_positions(batch, self.depth) if batch is not None
                     else torch.zeros(self.depth, dtype=torch.int64, device=self.device))
            normalizer = self.ranks.sum(local)  # [K] loss positions of the whole global micro-batch
        if batch is None and not self.sharded:
            return None
        with self.ranks.collectives("a training micro-batch's forward and backward, where FSDP2 "
                                    "all-gathers the weights and reduce-scatters the gradients"):
            res = self._loss(batch if batch is not None else self.empty_batch(), normalizer)
            (res.loss / self.grad_accum).backward()
            if self.sharded:
                reshard(self.draft, self.method.fsdp_units(self.draft))
        return res if batch is not None else None

    def loss_value(self, res: LossResult | None) -> float:
        """The micro-batch's loss as logged; with several ranks the sum of their parts."""
        if not self.ranks.distributed:
            return res.loss.item()
        loss = res.loss.detach().float().reshape(1) if res is not None else torch.zeros(1, device=self.device)
        return self.ranks.sum(loss).item()

    def sum_stats(self, stats: LossStats) -> LossStats:
        """In place: the counters of all ranks (a no-op with one rank)."""
        if self.ranks.distributed:
            stats.all_reduce(self.ranks, self.depth, self.device)
        return stats

    def optimizer_step(self) -> float:
        if self.ranks.distributed and not self.sharded:  # each rank's loss is already divided by the global count: sum, not mean
            for p in self.draft.trainable_parameters():
                if p.grad is None:  # this rank had no sample in the step
                    p.grad = torch.zeros_like(p)
                self.ranks.sum(p.grad)
        with self.ranks.collectives("the optimizer step, whose gradient norm over the shards is an all-reduce"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.trainable_parameters(), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            return float(grad_norm)

    @torch.no_grad()
    def evaluate(self, batch: DraftBatch | None) -> LossResult | None:
        """None: this rank has no share of the batch (sharded: it still runs the forward)."""
        with self.ranks.collectives("an evaluation forward, where FSDP2 all-gathers the weights"):
            if batch is None:
                if self.sharded:
                    self._loss(self.empty_batch())
                return None
            return self._loss(batch)

    def state_dicts(self) -> tuple[dict, dict]:
        """(draft tensors, optimizer state), unsharded. Sharded: a collective, complete on rank 0."""
        if self.sharded:
            with self.ranks.collectives("gathering the sharded state for a checkpoint"):
                return full_state(self.draft, self.optimizer)
        return draft_state(self.draft), self.optimizer.state_dict()

    def load_state_dicts(self, tensors: dict, optim: dict) -> None:
        if self.sharded:
            with self.ranks.collectives("loading the checkpoint into the shards"):
                load_full_state(self.draft, self.optimizer, tensors, optim)
        else:
            self.draft.load_state_dict(tensors, strict=False)
            self.optimizer.load_state_dict(optim)
        self.method.attach_target(self.draft, self.lm_head)  # not in a checkpoint: the target's own

    def plain_draft(self) -> torch.nn.Module | None:
        """The trained draft as a plain module on the host (sharded: a collective; None off rank 0)."""
        if not self.sharded:
            return self.draft.cpu()
        with self.ranks.collectives("gathering the trained draft for its export"):
            model = full_model_state(self.draft)
            head = self.lm_head.full() if isinstance(self.lm_head, VocabShard) else self.lm_head  # on rank 0
        return unsharded_copy(self.method, self.draft, model, head.cpu()) if self.ranks.main else None


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
