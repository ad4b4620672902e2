"""AdamW (optionally with its state on another device) and the LR schedule: linear warmup, then
cosine decay to zero (`cosine`) or a constant peak ended by a linear decay to zero (`wsd`,
warmup-stable-decay: a short run spends most of its steps at the peak LR instead of on a
tail near zero)."""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch


def host_threads(setting: int | None, device: str = "cuda", local_ranks: int | None = None) -> int | None:
    """CPU threads of a rank's host AdamW (hw.host_threads_per_rank): the setting; else on a GPU
    run the cores this process may run on shared by the node's local ranks (torchrun's
    LOCAL_WORLD_SIZE; torchrun sets OMP_NUM_THREADS=1 for every rank, which would leave the host
    optimizer one core); on a CPU run None (hw.trainer_threads, the process's own)."""
    if setting:
        return int(setting)
    if device == "cpu":
        return None
    local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


def rank_threads(device: str, trainer_threads: int, host_threads_per_rank: int | None,
                 optimizer_device: str | None) -> int | None:
    """The intra-op threads a trainer rank's process runs on (None: leave them): a CPU run's
    hw.trainer_threads; on a GPU with train.optimizer_device=cpu the host AdamW's (`host_threads`),
    so the clipping over the host grads beside it runs on them too."""
    if device == "cpu":
        return trainer_threads
    return host_threads(host_threads_per_rank, device) if optimizer_device == "cpu" else None


@contextmanager
def _threads(n: int | None):
    """torch's intra-op threads at `n` inside (None: unchanged), the process's own count after."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HostAdamW(torch.optim.AdamW):
    """torch's fused CPU AdamW (one vectorised pass per tensor; the default per-tensor loop is
    ~12x slower per thread, docs/PERFORMANCE.md §3.1) over parameters in host memory, stepping on
    `threads` intra-op threads: the FSDP2-offloaded shards of a co-located rank
    (train.optimizer_device=cpu). Not bitwise equal to the loop: its m/v/weight updates round
    differently in the last bit (tests/train/test_optim.py)."""

    def __init__(self, params, threads: int | None = None, **adamw_kwargs):
        super().__init__(params, fused=True, **adamw_kwargs)
        self.threads = threads

    @torch.no_grad()
    def step(self, closure=None):
        with _threads(self.threads):
            return super().step(closure)


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW whose fp32 master weights, gradient copies and m/v state live on `device` (host
    memory or another GPU), for a trainer GPU that cannot hold them.

    The model keeps its fp32 weights and gradients (clipped and all-reduced there as usual);
    `step` copies the gradients to `device`, updates the master weights there and copies them
    back. The update is torch's AdamW on the same numbers (tests/train/test_optim.py). The master
    copies are allocated here, once; m and v on the first step, as in torch.
    """

    def __init__(self, params, device, threads: int | None = None, **adamw_kwargs):
        self.model_params = [p for p in params]
        on_host = torch.device(device).type == "cpu"
        self.threads = threads if on_host else None  # the host AdamW's intra-op threads
        pin = on_host and torch.cuda.is_available()
        masters = []
        for p in self.model_params:
            m = p.detach().to(device, torch.float32, copy=True)
            m.grad = torch.zeros_like(m)
            if pin:  # page-locked: the copies to and from the GPU run at full PCIe speed
                m, m.grad = m.pin_memory(), m.grad.pin_memory()
            masters.append(m)
        # on the host: torch's fused CPU AdamW (one vectorised, multi-threaded pass per tensor)
        super().__init__(masters, **({"fused": True} if on_host else {}), **adamw_kwargs)

    @property
    def masters(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                m.grad = None  # AdamW skips a parameter without a gradient, as it would on the model
            else:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad)
        with _threads(self.threads):
            loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def load_state_dict(self, state_dict):
        """m, v and step counts from a checkpoint; the master weights from the model (restored first)."""
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, m in zip(self.model_params, self.masters):
                m.copy_(p)


def build_optimizer(params, lr: float, betas, weight_decay: float, device: str | None = None,
                    offloaded: bool = False, threads: int | None = None) -> torch.optim.AdamW:
    """AdamW on the parameters' device, or with its state on `device` (cpu | cuda:N; OffloadedAdamW).
    offloaded: the parameters are shards FSDP2 keeps in host memory (co-located,
    train.optimizer_device=cpu): HostAdamW over them. threads: the host AdamW's intra-op threads
    (`host_threads`; None: the process's). A run without an optimizer_device keeps torch's default
    AdamW, whichever its device."""
    kwargs = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=1e-8)
    params = list(params)
    if offloaded:
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("offloaded=True: every parameter must be in host memory (FSDP2's CPU offload)")
        return HostAdamW(params, threads=threads, **kwargs)
    if device in (None, "", "none") or (params and torch.device(device) == params[0].device):
        return torch.optim.AdamW(params, **kwargs)
    return OffloadedAdamW(params, device, threads=threads, **kwargs)


def _warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return max(1, math.ceil(round(warmup_ratio * total_steps, 6))) if warmup_ratio > 0 else 0  # 0.07*100 != 7.0


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """LR multiplier for step s (0-based): linear warmup over ceil(ratio*total), then cosine to 0."""
    warmup = _warmup_steps(total_steps, warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def warmup_stable_decay(total_steps: int, warmup_ratio: float, decay_ratio: float):
    """LR multiplier for step s (0-based): linear warmup over ceil(warmup_ratio*total), the peak
    until the last D = ceil(decay_ratio*total) steps (at most what warmup leaves), then linear to 0:
    step total-D+i (i = 0..D-1) gets (D-i)/(D+1), so the last step still moves the weights."""
    warmup = _warmup_steps(total_steps, warmup_ratio)
    decay = min(math.ceil(round(decay_ratio * total_steps, 6)), max(0, total_steps - warmup))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        into_decay = step - (total_steps - decay)
        if into_decay < 0:
            return 1.0
        return max(0.0, (decay - into_decay) / (decay + 1))

    return factor


SCHEDULES = ("cosine", "wsd")


def lr_factor(schedule: str, total_steps: int, warmup_ratio: float, decay_ratio: float = 0.0):
    """The LR multiplier function of train.lr_schedule."""
    if schedule == "cosine":
        return warmup_cosine(total_steps, warmup_ratio)
    if schedule == "wsd":
        return warmup_stable_decay(total_steps, warmup_ratio, decay_ratio)
    raise ValueError(f"train.lr_schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")


def build_scheduler(optimizer, total_steps: int, warmup_ratio: float, schedule: str = "cosine",
                    decay_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, total_steps, warmup_ratio, decay_ratio))
