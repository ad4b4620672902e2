"""AdamW with its state on another device (train/optim.py::OffloadedAdamW) against torch's AdamW
on the model's own device, through clipping, the LR schedule, a missing gradient and a resume."""
from __future__ import annotations

import pytest
import torch

from specforge_k25.train.checkpoint import load_checkpoint, save_checkpoint
from specforge_k25.train.optim import OffloadedAdamW, build_optimizer, build_scheduler


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))


def _train(model, opt, sched, steps: range, skip_grad_of: int | None = None):
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        if skip_grad_of is not None and s == 1:
            list(model.parameters())[skip_grad_of].grad = None  # e.g. a data-parallel rank without a sample
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, tol: float):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("skip", [None, 2])
def test_offloaded_adamw_equals_adamw(skip):
    ref, off = _model(), _model()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)
    opt_ref = torch.optim.AdamW(ref.parameters(), **kw)
    opt_off = OffloadedAdamW(off.parameters(), "cpu", **kw)
    assert opt_off.defaults["fused"] is True  # host: the fused CPU kernel
    s_ref, s_off = build_scheduler(opt_ref, 6, 0.3), build_scheduler(opt_off, 6, 0.3)
    _train(ref, opt_ref, s_ref, range(6), skip)
    _train(off, opt_off, s_off, range(6), skip)
    assert all(p.grad is None for p in off.parameters())
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), _model().parameters()))
    assert moved > 1e-3  # the weights really moved
    _assert_same(ref, off, 1e-6)  # fused vs for-loop kernel: rounding only
    # the master copies are the model's weights
    for p, m in zip(off.parameters(), opt_off.masters):
        assert m is not p and torch.equal(m, p)
    # a deliberate bug is caught: the copy back skipped
    broken = _model()
    opt_b = OffloadedAdamW(broken.parameters(), "cpu", **kw)
    opt_b.model_params = []  # step updates the masters only
    _train(broken, opt_b, build_scheduler(opt_b, 6, 0.3), range(1))
    with pytest.raises(AssertionError):
        _assert_same(ref, broken, 1e-6)


def test_offloaded_adamw_resumes_exactly(tmp_path):
    kw = dict(lr=3e-3, betas=[0.9, 0.95], weight_decay=0.01)
    straight = _model()
    opt = OffloadedAdamW(straight.parameters(), "cpu", **{**kw, "betas": (0.9, 0.95)})
    sched = build_scheduler(opt, 6, 0.3)
    _train(straight, opt, sched, range(6))

    first = _model()
    opt1 = OffloadedAdamW(first.parameters(), "cpu", **{**kw, "betas": (0.9, 0.95)})
    sched1 = build_scheduler(opt1, 6, 0.3)
    _train(first, opt1, sched1, range(3))

    class _Draft(torch.nn.Module):  # checkpoint.py's draft interface: a state_dict
        def __init__(self, m):
            super().__init__()
            self.m = m

    path = save_checkpoint(tmp_path, 3, _Draft(first).state_dict(), opt1.state_dict(), sched1.state_dict(), {})
    resumed = _model(seed=7)  # different init: everything must come from the checkpoint
    opt2 = OffloadedAdamW(resumed.parameters(), "cpu", **{**kw, "betas": (0.9, 0.95)})
    sched2 = build_scheduler(opt2, 6, 0.3)
    load_checkpoint(path, _Draft(resumed), opt2, sched2)
    for p, m in zip(resumed.parameters(), opt2.masters):
        assert torch.equal(m, p)  # masters re-synced from the restored model
    _train(resumed, opt2, sched2, range(3, 6))
    _assert_same(straight, resumed, 0.0)


def test_build_optimizer_offloads_only_to_another_device():
    model = _model()
    assert type(build_optimizer(model.parameters(), 1e-3, [0.9, 0.95], 0.0)) is torch.optim.AdamW
    assert type(build_optimizer(model.parameters(), 1e-3, [0.9, 0.95], 0.0, device="cpu")) is torch.optim.AdamW
    assert isinstance(build_optimizer(model.parameters(), 1e-3, [0.9, 0.95], 0.0, device="meta"), OffloadedAdamW)


def _offloaded_shards():
    """A 1-rank gloo group and the model sharded by FSDP2 with its CPU offload (the co-located
    layout's train.optimizer_device=cpu); the caller destroys the group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # no port: tests run side by side
    model = _model()
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def test_offloaded_shards_step_with_fused_host_adamw_on_the_configured_threads(monkeypatch):
    """train.optimizer_device=cpu co-located: torch's fused CPU AdamW over the FSDP2 host shards,
    stepping on hw.host_threads_per_rank threads (torchrun leaves a rank 1), the process's own
    count back after; the same numbers as the fused kernel on one thread over plain tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from specforge_k25.train.optim import HostAdamW

    seen = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (seen.append(torch.get_num_threads()), fused(*a, **k))[1])
    kw = dict(lr=3e-3, betas=[0.9, 0.95], weight_decay=0.01)
    before = torch.get_num_threads()
    model = _offloaded_shards()
    try:
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
        opt = build_optimizer(model.parameters(), device=None, offloaded=True, threads=before + 2, **kw)
        assert type(opt) is HostAdamW and opt.param_groups[0]["fused"]
        ref = _model()
        torch.set_num_threads(1)
        opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, eps=1e-8, **kw)
        torch.set_num_threads(before)
        for s in range(3):
            x = torch.randn(8, 12, generator=torch.Generator().manual_seed(s))
            for m, o, threads in ((model, opt, before), (ref, opt_ref, 1)):
                torch.set_num_threads(threads)
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
            assert torch.get_num_threads() == 1  # restored after HostAdamW's step (then the reference's 1)
            torch.set_num_threads(before)
        assert seen == [before + 2, 1] * 3, seen
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), name
    finally:
        torch.set_num_threads(before)
        dist.destroy_process_group()


def test_host_adamw_equals_the_loop_to_float32_rounding():
    """The fused kernel rounds m/v/weights its own way: within float32 rounding of torch's
    per-tensor AdamW, not bit for bit (the default path keeps the latter, so a run's numbers do
    not change). Whether the last bits differ depends on the data and the CPU path (on this
    machine: they do with MKL's AVX-512 branch, not with its AVX2 one), so only the bound is asserted."""
    a, b = _model(), _model()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)
    oa, ob = torch.optim.AdamW(a.parameters(), **kw), build_optimizer(b.parameters(), 3e-3, kw["betas"], 0.01,
                                                                      offloaded=True, threads=1)
    for s in range(5):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(s))
        for m, o in ((a, oa), (b, ob)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_same(a, b, 1e-6)


def test_host_threads_default_to_the_cores_per_local_rank(monkeypatch):
    from specforge_k25.train import optim

    monkeypatch.setattr(optim.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert optim.host_threads(None, "cuda") == 8 and optim.host_threads(None, "cuda", local_ranks=3) == 21
    assert optim.host_threads(5, "cuda") == 5 and optim.host_threads(5, "cpu") == 5
    assert optim.host_threads(None, "cpu") is None  # a CPU run keeps hw.trainer_threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert optim.host_threads(None, "cuda") == 1
    with pytest.raises(ValueError, match="host memory"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2, device="meta"))], 1e-3, (0.9, 0.95), 0.0, offloaded=True)


def test_a_gpu_rank_with_the_optimizer_on_the_host_runs_on_its_host_threads(monkeypatch):
    """trainer.py sets these at start: a CPU run keeps hw.trainer_threads; a GPU rank with
    train.optimizer_device=cpu gets the host AdamW's threads for all its host work (the clipping
    over the host grads too); other GPU ranks stay as torchrun left them."""
    from specforge_k25.train import optim

    monkeypatch.setattr(optim.os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert optim.rank_threads("cpu", 2, 7, "cpu") == 2 and optim.rank_threads("cpu", 2, None, None) == 2
    assert optim.rank_threads("cuda", 1, None, "cpu") == 4 and optim.rank_threads("cuda", 1, 6, "cpu") == 6
    assert optim.rank_threads("cuda", 1, 6, None) is None and optim.rank_threads("cuda", 1, None, "cuda:1") is None
