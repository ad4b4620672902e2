"""What runs inside a target process (one per target rank): the engine over a fixed list of
batches, the hidden states into a `SlotRing` (stream/target_stream.py starts these processes and
reads the ring).

TP rank 0 (`run_producer`) walks the batches and broadcasts each batch's token ids to the other TP
ranks (`run_tp_rank`), which run the same forward (or, regenerating, the same decoding of a group
of prompts). Dedicated trainer: only rank 0 writes into a ring. Co-located trainer ranks: every TP
rank writes its own trainer's share of each batch (`keep`) into its own ring on the same GPU.

A pipeline-parallel target (spec.pp_size stages, world rank = tp_size * stage + TP rank): every
rank runs `run_producer` over the same batches (no broadcast, so the stages overlap). Dedicated
trainer: the last stage's TP rank 0 holds the whole states and fills the ring; co-located: the last
stage hands every rank its share (stream/pipeline_shares.py).
"""
from __future__ import annotations

import os
import signal
import sys
import traceback

import psutil
import torch

from ..target_engine.factory import TargetSpec, build_target
from ..target_engine.pages import batch_slots, pool_floor, whole_pages
from ..target_engine.sampling import generation_slots, kv_slots
from .pipeline_shares import StageShares
from .progress import BatchProgress
from .channel import bars_with_a_thread_lock
from .ring import EndOfStream, ProducerFailed, SeqWindow, SlotRing


# Signals that reach a whole process group: Ctrl-C (SIGINT) and SIGTERM from torchrun (it signals
# each rank's process group), Slurm or `kill -- -PGID`. The trainer decides: it stops at a batch
# boundary, saves (co-located ranks gather their shards first, which needs their TP ranks to keep
# serving) and then stops its target. The parent blocks them around the start (`_start_quietly`),
# so one that arrives while this process starts up waits until it is ignored here.
GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def bind_to_trainer() -> None:
    """Linux: have the kernel SIGKILL this process when the trainer dies, even by SIGKILL (no
    orphans); ignore the group signals (the trainer stops this process when it is done); no named
    semaphore for its progress bars."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    bars_with_a_thread_lock()


def put_share(ring: SlotRing, index: int, out, keep: list[int] | None, ids: torch.Tensor | None,
               prompt_lengths: list[int] | None, window: SeqWindow | None = None) -> None:
    """Message `index` of the ring: the sequences of a forward's output at positions `keep` (None: all),
    with `window` (context parallelism) only its rows of each of them."""
    if keep is None:
        ring.put(index, out.aux_hidden, out.final_hidden, out.lengths, ids, prompt_lengths)
        return
    starts = [0]
    for n in out.lengths:
        starts.append(starts[-1] + n)
    lengths = [out.lengths[p] for p in keep]
    spans = window.spans(lengths) if window is not None else [(0, n) for n in lengths]

    def rows(t):
        return torch.cat([t[starts[p] + a:starts[p] + b] for p, (a, b) in zip(keep, spans)])

    ring.put(index, rows(out.aux_hidden), rows(out.final_hidden), [b - a for a, b in spans],
             rows(ids) if ids is not None else None,
             [prompt_lengths[p] for p in keep] if prompt_lengths is not None else None)


def run_producer(spec: TargetSpec, tokens: torch.Tensor, offsets: torch.Tensor, batches: list,
                   ring: SlotRing | None, parent_pid: int, keep: list | None = None, before: list = (),
                   routes: list | None = None, rank: int = 0, report=None, window: SeqWindow | None = None,
                   progress: BatchProgress | None = None, known: dict | None = None):
    """Entry point of the target process of TP rank 0, and of every rank of a pipeline-parallel target.
    tokens: all sequences concatenated; offsets [N+1]. keep: per batch, the positions its ring
    carries (co-located; None: every sequence), `window` its rows of each (context parallelism). before: the batches a resumed run already trained
    on, not run again; regenerating, they place the remaining prompts in the groups an
    uninterrupted run decodes them in (`regeneration_groups`); `known`: the conversations saved
    already (`Regenerated`), not decoded again.
    A pipeline-parallel target (spec.pp_size > 1): every rank (world rank `rank`) walks the same
    batches itself, so no stage waits for another's turn at a per-batch broadcast and the stages
    overlap (stage s forwards batch i while stage s+1 forwards batch i-1). `ring` is None on a rank
    that fills none (failures then go to `report`): with a dedicated trainer, the last stage's TP
    rank 0 fills it; co-located, `routes` (every rank's share of every batch) says what the last
    stage sends each rank's ring (stream/pipeline_shares.py). `progress`: this rank's row records the
    batches it started and finished (stream/progress.py)."""
    bind_to_trainer()
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        return
    torch.set_num_threads(spec.num_threads)
    stage = "engine start"
    try:
        target = build_target(spec, tp_rank=rank % spec.tp_size, pp_rank=rank // spec.tp_size)
        torch.set_num_threads(spec.num_threads)
        broadcasts = spec.pp_size == 1 and spec.tp_size > 1  # TP rank 0 leads the other TP ranks (run_tp_rank)
        route = StageShares(target, rank, ring, routes, tp_size=spec.tp_size, pp_size=spec.pp_size) if routes else None
        pool = target.max_total_tokens  # SGLang sizes its KV pool from free memory at start
        page = getattr(target, "kv_page_size", 1)
        largest = max((batch_slots([sequence_room(spec, int(offsets[i + 1] - offsets[i])) for i in b], page)
                       for b in batches), default=0)
        if pool is not None and largest > pool:
            raise ValueError(f"the largest batch needs {largest} KV slots (whole pages of {page} tokens per sequence) "
                             f"but the engine's KV pool holds {pool}: {pool_advice(pool, spec.max_total_tokens, largest, page)}")
        ahead = None
        if spec.regeneration is not None:
            stage = "regeneration groups"
            ahead = Regenerated(target, spec, tokens, offsets, [*before, *batches], start=len(before), known=known)
        stage = "engine warmup"
        target.warmup()
        io = psutil.Process().io_counters
        ready_bytes = io().write_bytes
        sent = 0
        for item, batch in enumerate(batches):
            stage = f"target forward of batch {item}"
            if progress is not None:
                progress.started(rank, item)
            seqs = [tokens[offsets[i]:offsets[i + 1]] for i in batch]
            ids = prompt_lengths = None
            if ahead is not None:
                stage = f"regeneration up to batch {item}"
                seqs, prompt_lengths = ahead.take(len(before) + item)
                ids = torch.cat(seqs)
                stage = f"target forward of batch {item}"
            if broadcasts:
                target.share_batch([FORWARD, *seqs])  # the other TP ranks run the same forward
            out = target.forward(seqs)
            if route is not None:
                route.deliver(item, seqs, out)
            elif ring is not None and (keep is None or keep[item]):
                put_share(ring, sent, out, keep[item] if keep is not None else None, ids, prompt_lengths, window)
                sent += 1
            if progress is not None:
                progress.finished(rank, item)
        if broadcasts:
            stage = "end of the batches (telling the other TP ranks)"
            target.share_batch(None)
        if route is not None:
            stage = "receiving the last stage's states"
            sent = route.finish()
        streamed_bytes = io().write_bytes - ready_bytes  # up to the last batch: close() writes the routing counts
        target.close()
        if ring is not None:
            ring.ready.put(EndOfStream(sent, ready_bytes, streamed_bytes))
    except BaseException as err:  # report, never hang the trainer
        (ring.ready if ring is not None else report).put(
            ProducerFailed(stage, f"{type(err).__name__}: {err}\n{traceback.format_exc()}", rank=rank))
        raise


def sequence_room(spec: TargetSpec, length: int) -> int:
    """Tokens a sequence of `length` occupies in the engine and the ring (its answer included)."""
    return length + (spec.regeneration.budget(length) if spec.regeneration is not None else 0)


def pool_advice(pool: int, requested: int, need: int, page: int) -> str:
    """What raises the engine's KV pool to `need` slots. SGLang's pool is the smaller of what its
    static memory holds and the requested cap (hw.max_total_tokens as the plan raises it), floored to
    whole pages (target_engine/pages.py): at the cap, only a larger cap helps; below it, memory."""
    if pool >= pool_floor(requested, page):
        return (f"the pool is at its cap (hw.max_total_tokens, {requested} requested): set "
                f"hw.max_total_tokens={whole_pages(need, page)}, or lower train.batch_size or data.max_length")
    return (f"SGLang's static memory holds only {pool} of the {requested} requested: raise hw.mem_fraction_static "
            f"(`python -m specforge_k25.plan` derives it), or lower train.batch_size or data.max_length")


# what TP rank 0 broadcasts ahead of the sequences, so the other ranks take the same step
FORWARD, GENERATE = torch.tensor([0]), torch.tensor([1])


def regeneration_groups(batches: list, prompt_len, regen, pool: int | None, page_size: int = 1) -> list[list[int]]:
    """The samples decoded together (`Regenerated`): a function of the whole schedule, walked from
    its first batch, so that a resumed run decodes every prompt in the same group (the same batch
    makeup, hence the same kernels and answers) as an uninterrupted run. A sample belongs to the
    group open at its first use; a group takes a batch's new samples whole, and closes before a
    batch that would take it past regen.group_sequences prompts or `pool` KV slots."""
    groups, group, room, seen = [], [], 0, set()
    for batch in batches:
        new = [i for i in dict.fromkeys(batch) if i not in seen]
        need = sum(kv_slots(prompt_len(i), regen.budget(prompt_len(i)), page_size) for i in new)
        if group and new and (len(group) + len(new) > regen.group_sequences
                              or (pool is not None and room + need > pool)):
            groups.append(group)
            group, room = [], 0
        group += new
        room += need
        seen.update(new)
    return groups + [group] if group else groups


class Regenerated:
    """TP rank 0's answers, generated ahead of the forwards in the groups of `regeneration_groups`
    (decoding a batch of prompts costs about as much per step as decoding one), each group within
    the configured KV pool (spec.max_total_tokens: not the engine's, which depends on free memory).
    `batches` is the whole schedule; a resumed run starts at `start`.

    Each prompt is decoded at most once per run: a conversation used again later (a later epoch, a
    held-out sample at every evaluation) is held until its last use, as int32 ids (4 bytes a token
    of host memory, for the samples still to be used again). `known` ({sample: prompt + answer}, the
    answers saved by this run before a resume or by an earlier run, train/answer_store.py) are never
    decoded: a group decodes only its other members still to be used. A group none of whose members
    is known decodes whole, as in an uninterrupted run (its makeup decides the decode kernels, hence
    the answers), even the members a resume no longer uses."""

    def __init__(self, target, spec: TargetSpec, tokens: torch.Tensor, offsets: torch.Tensor, batches: list,
                 start: int = 0, known: dict[int, torch.Tensor] | None = None):
        self.target, self.spec, self.batches = target, spec, batches
        self.prompt = lambda i: tokens[offsets[i]:offsets[i + 1]]
        self.known = known or {}
        regen = spec.regeneration
        page = getattr(target, "kv_page_size", 1)
        self.groups = regeneration_groups(batches, lambda i: len(self.prompt(i)), regen, spec.max_total_tokens, page)
        self.group_of = {i: g for g, group in enumerate(self.groups) for i in group}
        pool = getattr(target, "max_total_tokens", None)  # the engine's; None: no KV pool (the HF reference)
        need = max((generation_slots([len(self.prompt(i)) for i in group],
                                     [regen.budget(len(self.prompt(i))) for i in group], page)
                    for group in self.groups), default=0)
        if pool is not None and need > pool:
            raise ValueError(f"a regeneration group needs {need} KV slots but the engine's pool holds {pool}: "
                             f"lower data.regen_group, or {pool_advice(pool, spec.max_total_tokens, need, page)}")
        self.ready: dict[int, torch.Tensor] = {}  # sample -> its conversation (int32), until its last use
        self.uses: dict[int, int] = {}  # sample -> how many items still use it
        for item in range(start, len(batches)):
            for i in batches[item]:
                self.uses[i] = self.uses.get(i, 0) + 1
        self.decoded = 0  # prompts this process decoded (each once)

    def take(self, item: int) -> tuple[list[torch.Tensor], list[int]]:
        """Batch `item`'s conversations (prompt + answer) and prompt lengths."""
        batch = self.batches[item]
        for i in batch:
            if i not in self.ready:
                if i in self.known:
                    self.ready[i] = self.known[i].to(torch.int32)
                else:
                    self._generate(self.group_of[i])
        conversations = [self.ready[i].to(torch.int64) for i in batch]
        for i in batch:
            self.uses[i] -= 1
            if not self.uses[i]:
                self.ready.pop(i, None)
        return conversations, [len(self.prompt(i)) for i in batch]

    def _generate(self, g: int) -> None:
        group = self.groups[g]
        if any(i in self.known for i in group):  # its makeup is gone: only the members still to be used
            group = [i for i in group if i not in self.known and self.uses.get(i)]
        prompts = [self.prompt(i) for i in group]
        if self.spec.tp_size > 1:
            self.target.share_batch([GENERATE, *prompts])
        self.decoded += len(group)
        for i, conversation in zip(group, regenerate(self.target, prompts, self.spec.regeneration)):
            if self.uses.get(i):  # not a member a resume no longer uses
                self.ready[i] = conversation.to(torch.int32)


def regenerate(target, prompts: list[torch.Tensor], regen) -> list[torch.Tensor]:
    """prompt + the target's own answer, per sequence. The answer is generated first, then the
    whole conversation is prefilled as any training batch is: its hidden states are exactly those of
    a plain prefill of the same ids (capturing during decoding would give the decode kernels'
    numbers instead; docs/PERFORMANCE.md measures both)."""
    answers = target.generate(prompts, [regen.budget(len(p)) for p in prompts], regen)
    return [torch.cat([p, torch.tensor(a, dtype=p.dtype)]) for p, a in zip(prompts, answers)]


def run_tp_rank(spec: TargetSpec, tp_rank: int, report, parent_pid: int, ring: SlotRing | None = None,
                  shares: tuple | None = None, progress: BatchProgress | None = None):
    """Entry point of a TP rank other than 0 (one pipeline stage): the same engine start, warm-up and
    forwards as rank 0, batch by batch as rank 0 broadcasts them, until rank 0 says the batches are
    done. Its outputs are dropped (rank 0 holds the full hidden states), unless it feeds a
    co-located trainer rank: then `ring` gets its share of each batch, `shares` = (prompt lengths of
    every sample, the batches, keep, the SeqWindow of context parallelism or None). A failure goes
    to `report` (a channel the trainer reads on the trainer's node; None elsewhere: the traceback
    and exit code tell). `progress` (the trainer's node): the batches this rank started (a broadcast
    of its forward or of its regeneration reached it) and finished."""
    bind_to_trainer()
    if os.getppid() != parent_pid:
        return
    torch.set_num_threads(spec.num_threads)
    stage = "engine start"
    try:
        target = build_target(spec, tp_rank=tp_rank)
        torch.set_num_threads(spec.num_threads)
        stage = "engine warmup"
        target.warmup()
        io = psutil.Process().io_counters
        ready_bytes = io().write_bytes
        step = item = sent = 0
        while True:
            stage = f"target step {step}"
            message = target.share_batch(None)
            if message is None:
                break
            op, seqs = message[0], message[1:]
            step += 1
            if progress is not None:  # rank 0 regenerates batch `item`'s answers before its forward
                progress.started(tp_rank, item)
            if torch.equal(op, GENERATE):  # every TP rank decodes in step with rank 0 (same tokens drawn)
                regenerate(target, seqs, spec.regeneration)
                continue
            out = target.forward(seqs)
            if ring is not None and shares[2][item]:
                prompt_len, batches, keep, window = shares
                regen = spec.regeneration is not None
                put_share(ring, sent, out, keep[item], torch.cat(seqs) if regen else None,
                           [prompt_len[i] for i in batches[item]] if regen else None, window)
                sent += 1
            if progress is not None:
                progress.finished(tp_rank, item)
            item += 1
        streamed_bytes = io().write_bytes - ready_bytes  # up to the last batch: close() writes the routing counts
        target.close()
        if ring is not None:
            ring.ready.put(EndOfStream(sent, ready_bytes, streamed_bytes))
    except BaseException as err:
        if report is not None:
            report.put(ProducerFailed(stage, f"{type(err).__name__}: {err}\n{traceback.format_exc()}", rank=tp_rank))
        raise
