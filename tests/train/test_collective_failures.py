"""A collective that fails inside the draft's step (a peer died or hung) is the same named failure
as one the trainer calls: RankFailed, naming what failed, which train/trainer.py ends with the
newest checkpoint and the resume command and train/__main__.py with the data-parallel failure exit.
gloo and NCCL raise plain RuntimeErrors; FSDP2 runs its all-gathers and reduce-scatters in hooks,
DTensor its norm all-reduce, and context parallelism its exchanges inside autograd."""
from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from specforge_k25.train.context_parallel import SeqShard
from specforge_k25.train.distributed import RankFailed, Ranks

GLOO_PEER_GONE = ("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:15764. "
                  "This is typically caused by a remote worker crashing.")


def test_only_an_error_from_inside_torch_distributed_is_a_rank_failure():
    ranks = Ranks(rank=1, world=2)
    with pytest.raises(RankFailed, match=r"^trainer rank 1 of 2: a collective with the other ranks \(torch.distributed "
                                         r"\w*rendezvous\w*\) failed during a test step; another rank died or hung: "
                                         r"No rendezvous handler"):
        with ranks.collectives("a test step"):
            dist.rendezvous("nowhere://")  # a RuntimeError raised in torch.distributed's own code
    own_errors = RuntimeError("mat1 and mat2 shapes cannot be multiplied"), torch.OutOfMemoryError("CUDA out of memory")
    for own in own_errors:
        with pytest.raises(type(own)) as err:
            with ranks.collectives("a test step"):
                raise own  # the step's own error: not a peer's
        assert type(err.value) is type(own)
    with pytest.raises(RuntimeError, match="No rendezvous handler") as err:  # one rank: no peer to blame
        with Ranks().collectives("a test step"):
            dist.rendezvous("nowhere://")
    assert not isinstance(err.value, RankFailed)


def test_a_failed_context_parallel_exchange_is_named_in_forward_and_backward(monkeypatch):
    """gloo's error out of the all-to-all of Ulysses attention, in its forward and in its backward
    (autograd passes the RankFailed on), and out of the MLA latents' all-gather."""
    calls = []

    def all_to_all_single(out, x, group=None):
        calls.append("all_to_all")
        if len(calls) > 1:  # the forward's exchange goes through, the backward's finds the peer gone
            raise RuntimeError(GLOO_PEER_GONE)
        out.copy_(x)

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    shard = SeqShard(group=None, rank=0, size=2, length=3)
    x = torch.randn(1, 4, 3, 2, requires_grad=True)
    y = shard.to_heads(x)
    with pytest.raises(RankFailed, match=r"context-parallel rank 0 of 2.*: the attention's all-to-all "
                                         r"\(heads <-> positions\) failed \(another rank of the group died or hung\): "
                                         r"\[third_party/gloo.*Connection closed by peer"):
        y.sum().backward()
    assert calls == ["all_to_all", "all_to_all"]
    with pytest.raises(RankFailed, match="the attention.s all-to-all"):
        shard.to_positions(y.detach())

    def all_gather(parts, x, group=None):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")

    monkeypatch.setattr(dist, "all_gather", all_gather)
    with pytest.raises(RankFailed, match="the all-gather of the MLA latents along the sequence failed.*Timed out"):
        shard.gather_positions(torch.randn(1, 3, 2))


# ------------------------------------------------ a peer gone inside FSDP2's hooks, two gloo ranks
def _sharded_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    from specforge_k25.draft.registry import method_of
    from specforge_k25.train.sharding import shard_draft
    from specforge_k25.train.learner import DraftLearner
    from ttt_reference import _tiny_setup  # tests/fixtures, on the path the test process hands over

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=10))
    cfg, draft, d2t, *_, lm_head = _tiny_setup(seed=1)
    draft, lm_head = draft.float(), lm_head.float()
    method = method_of(draft)
    shard_draft(draft, method.fsdp_units(draft))  # as the co-located layout shards it
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-3)
    ranks = Ranks(rank=rank, world=2, per_replica=2, colocated=True)
    learner = DraftLearner(method, draft, lm_head, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                           spec=method.spec_class(ttt_length=3), grad_accum=1, grad_clip=0.5, teacher_chunk=8,
                           autocast_bf16=False, ranks=ranks)
    n = 7
    sample = SimpleNamespace(input_ids=torch.randint(0, cfg.vocab_size, (n,)),
                             loss_mask=torch.ones(n, dtype=torch.bool))
    batch = learner.make_batch([sample], [n], torch.randn(n, 3 * cfg.target_hidden_size),
                               torch.randn(n, cfg.target_hidden_size))
    if rank == 1:  # takes part in the step's count all-reduce, then dies before FSDP2's all-gather
        ranks.sum(method.loss_positions(batch, learner.depth))
        os._exit(1)
    t0 = time.monotonic()
    try:
        learner.train_micro(batch)
        results.send(("returned", time.monotonic() - t0, ""))
    except Exception as err:
        results.send((type(err).__name__, time.monotonic() - t0, str(err)))
    os._exit(0)  # as a torchrun rank leaves (train/__main__.py): no teardown with gloo threads alive


@pytest.mark.slow
def test_a_peer_gone_inside_fsdp2s_hooks_is_a_named_rank_failure():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    reader, results = ctx.Pipe(duplex=False)  # sent before the rank's os._exit (a Queue's feeder thread is not)
    procs = [ctx.Process(target=_sharded_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert reader.poll(180), [p.exitcode for p in procs]
        kind, waited, message = reader.recv()
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    assert kind == "RankFailed", (kind, message)
    assert message.startswith("trainer rank 0 of 2: a collective with the other ranks (torch.distributed "), message
    assert "failed during a training micro-batch's forward and backward, where FSDP2 all-gathers the weights" in message
    assert "another rank died or hung" in message and "gloo" in message, message
    assert waited < 30, waited  # within the process group's timeout (10 s), not a hang
