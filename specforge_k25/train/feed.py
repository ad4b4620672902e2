"""How the trainer takes each target batch off the stream: copied out of its slot (then the slot
goes back), and, regenerating, rebuilt from the target's own conversations."""
from __future__ import annotations

import torch

from ..data.regenerate import regenerated_sample
from ..target_engine.sampling import Regeneration


def take_batches(stream, shares: list[list[int]], samples, make_batch, rebuild=None):
    """(share, DraftBatch or None, regenerated) per schedule item, in order; None when this rank
    has no share of the item (it reads nothing from its stream for it). A slot goes back to the
    target only after `make_batch` has copied what it keeps out of it.

    Regeneration: the slot's ids are the target's conversations (prompt + its answer);
    `rebuild(ids, lengths, prompt_lengths)` turns them into [(Sample, status)] (`regenerated`),
    whose samples the batch is made of."""
    batches = iter(stream)
    for share in shares:
        batch = regenerated = None
        if share:
            msg, aux_packed, final_packed = next(batches)
            batch_samples = [samples[i] for i in share]
            if msg.prompt_lengths is not None:
                regenerated = rebuild(stream.ids(msg).clone(), msg.lengths, msg.prompt_lengths)
                batch_samples = [sample for sample, _ in regenerated]
            batch = make_batch(batch_samples, msg.lengths, aux_packed, final_packed)
            stream.release(msg)
        yield share, batch, regenerated
    next(batches, None)  # runs the stream to the target's end message (its I/O counters)


def rebuild_regenerated(regen: Regeneration, cut: str):
    """The `rebuild` of take_batches for a run's regeneration settings (data/regenerate.py rules)."""
    def rebuild(ids: torch.Tensor, lengths: list[int], prompt_lengths: list[int]):
        return [regenerated_sample(seq, p, regen.stop_ids, cut)
                for seq, p in zip(torch.split(ids, lengths), prompt_lengths)]
    return rebuild
