"""Which samples a trainer rank trains on at each schedule item, and the target stream that carries
them, for the three layouts (train/distributed.py `Ranks`):

- dedicated (one trainer rank per target replica): the stream runs this rank's shares only;
- co-located (a replica's TP ranks are its trainer ranks): each TP rank runs the replica's whole
  batches and its ring carries this rank's share of each;
- co-located beside pipeline stages (hw.target_pp > 1): the last stage hands every rank its share.

Regenerating, a resume also names the batches run before it (they place the rest in the same
decode groups) and the answers saved already (never decoded again).
"""
from __future__ import annotations

from dataclasses import dataclass

from .distributed import Ranks
from .schedule import BatchItem


@dataclass
class Routes:
    """This rank's part of the schedule items from the resume point on, item by item."""

    batches: list[list[int]]  # its replica's batch (what that replica's target runs)
    keep: list[list[int]]  # positions of this rank's share in that batch
    shares: list[list[int]]  # this rank's samples (empty: nothing to read for the item)


def route(items: list[BatchItem], ranks: Ranks, batch_size: int, sizes: list[int]) -> Routes:
    """The routes of `items`; `batch_size`: train.batch_size (sequences per rank), `sizes[i]`: the
    tokens sample i streams at least (its shares are balanced on them)."""
    batches = [ranks.replica_batch(item.sample_ids, batch_size) for item in items]
    keep = [ranks.share_positions(b, sizes) for b in batches]
    return Routes(batches, keep, [[b[p] for p in k] for b, k in zip(batches, keep)])


def batches_run_before(items: list[BatchItem], ranks: Ranks, batch_size: int, sizes: list[int]) -> list[list[int]]:
    """What this rank's target ran of the items before a resume, as it ran them (dedicated: this
    rank's shares; co-located: the replica's batches)."""
    routes = route(items, ranks, batch_size, sizes)
    return [b for b in (routes.shares if ranks.per_replica == 1 else routes.batches) if b]


def open_stream(factory, job, setup, samples, ranks: Ranks, routes: Routes, sizes: list[int], **stream_args):
    """The target stream (not yet started) of this rank's routes, from `factory` (setup/target.py
    `make_target_stream`'s signature); `sizes` as for `route`; `stream_args`: `known`, `before`."""
    if ranks.per_replica == 1:  # dedicated: the stream runs this rank's shares only
        return factory(job, setup, samples, [ids for ids in routes.shares if ids], **stream_args)
    pairs = [(b, k) for b, k in zip(routes.batches, routes.keep) if b]
    if job.hw.target_pp > 1:  # beside pipeline stages: the last stage hands every rank its share
        stream_args["routes"] = [ranks.replica_shares(b, sizes) for b, _ in pairs]
    return factory(job, setup, samples, [b for b, _ in pairs], keep=[k for _, k in pairs], ranks=ranks, **stream_args)
