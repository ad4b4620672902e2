"""train/sharding.py builds each rank's shards from the host without the whole weights on the
shards' device (units on the meta device, each rank's rows copied in): the shards must hold
exactly what FSDP2's own `fully_shard` of the whole draft gives that rank, bit for bit, for every
method's units, uneven splits included (ranks 0, 5 and 7 of a fake 8-rank process group: FSDP2
cuts dim 0 in chunks of ceil(rows / 8), so some ranks get fewer rows or none). The runs that
train with it (tests/train/test_sharding.py, test_colocated*.py) compare whole runs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from sharding_worker import _dflash, _eagle3
from specforge_k25.draft.registry import method_of
from specforge_k25.train.sharding import shard_draft


def _fully_shard_whole(draft, method, offload: bool):
    """The reference: FSDP2 sharding the whole draft where it is (what shard_draft did before)."""
    where = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for unit in method.fsdp_units(draft):
        fully_shard(draft.get_submodule(unit), **where)
    if not method.keep_units_gathered:
        fully_shard(draft, ignored_params={p for p in draft.parameters() if not p.requires_grad}, **where)


@pytest.mark.parametrize("rank", [0, 5, 7])
def test_shards_built_from_the_host_equal_fully_shard_of_the_whole_draft(rank):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        for make in (_eagle3, _dflash):
            for offload in (False, True):
                draft = make()[0]
                method = method_of(draft)
                reference = copy.deepcopy(draft)
                _fully_shard_whole(reference, method, offload)
                shard_draft(draft, method.fsdp_units(draft), keep_gathered=method.keep_units_gathered, offload=offload)
                ours, theirs = dict(draft.named_parameters()), dict(reference.named_parameters())
                assert ours.keys() == theirs.keys()
                sharded = 0
                for name, p in ours.items():
                    q = theirs[name]
                    assert type(p) is type(q) and p.requires_grad == q.requires_grad, name
                    if isinstance(p, torch.distributed.tensor.DTensor):
                        sharded += 1
                        a, b = p.to_local(), q.to_local()
                        assert p.placements == q.placements and a.device == b.device, name
                    else:
                        a, b = p, q
                    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (name, rank)
                assert sharded == sum(1 for p in ours.values() if p.requires_grad) > 0
    finally:
        dist.destroy_process_group()
