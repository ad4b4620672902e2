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
