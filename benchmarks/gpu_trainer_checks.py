"""GPU checks of the trainer's memory features (run on a CUDA machine; `--small` also runs on CPU).

1. fused TTT attention on CUDA: `ttt_loss` (loss and every gradient) in fp32 on the GPU against the
   same function in float64 on the CPU (itself checked against a float64 loop reference in
   tests/draft/test_draft.py), and bf16 autocast against float64 within bf16 tolerance;
2. activation checkpointing on CUDA: same loss and gradients as without;
3. which SDPA kernel the masked TTT attention gets on CUDA for the Kimi draft's heads in bf16:
   forward + backward of step K-1 at T under each backend alone (error = not applicable), with
   its peak memory;
4. `OffloadedAdamW` (master weights + m/v in pinned host memory) against torch's AdamW on the GPU
   over 5 steps, and the time of one host step for the Kimi draft's 963M parameters.

Prints a table and writes gpu_trainer_checks[_small].json into --out: $OUT where the device tool sets it
(only what is written there comes back), else benchmarks/results. The JSON is rewritten after each check.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
from pathlib import Path

import torch

from _common import RESULTS, GiB, machine_info, print_table, write_json
from specforge_k25.draft.objective import compute_teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.eagle3.model import Attention, DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.train.optim import OffloadedAdamW

KIMI = DraftConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=56, num_key_value_heads=8,
                   head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168)
SMALL = DraftConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=300, draft_vocab_size=64, target_hidden_size=64)


def _setup(cfg: DraftConfig, B: int, T: int, seed: int = 0):
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    d2t, t2d = build_vocab_maps(torch.randint(0, 100, (cfg.vocab_size,)), cfg.draft_vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    batch = dict(aux=torch.randn(B, T, 3 * cfg.target_hidden_size), ids=torch.randint(0, cfg.vocab_size, (B, T)),
                 mask=torch.rand(B, T) < 0.8, lengths=torch.tensor([T] + [T - 3] * (B - 1)),
                 final=torch.randn(B, T, cfg.target_hidden_size),
                 lm_head=0.3 * torch.randn(cfg.vocab_size, cfg.target_hidden_size))
    return draft, batch


def _run(draft, batch, device, dtype, K, bf16=False, checkpoint=False):
    draft = draft.to(device, dtype)
    b = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}
    teacher = compute_teacher(b["final"], b["lm_head"], draft.d2t)
    draft.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        res = ttt_loss(draft, b["aux"], b["ids"], b["mask"], b["lengths"], teacher, K, checkpoint=checkpoint)
    res.loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in draft.named_parameters() if p.requires_grad}
    return res.loss.detach().double().cpu(), grads


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)).item() for n in b)


def check_numerics(device, cfg, B, T, K) -> list[dict]:
    draft, batch = _setup(cfg, B, T)
    ref_loss, ref_grads = _run(copy.deepcopy(draft), batch, torch.device("cpu"), torch.float64, K)
    rows = []
    for name, kw in (("fp32", {}), ("fp32 checkpointed", {"checkpoint": True}), ("bf16 autocast", {"bf16": True}),
                     ("bf16 autocast checkpointed", {"bf16": True, "checkpoint": True})):
        loss, grads = _run(draft, batch, device, torch.float32, K, **kw)
        rows.append({"check": f"ttt_loss {name} on {device.type} vs float64 cpu",
                     "loss_rel": abs((loss - ref_loss) / ref_loss).item(), "grad_max_rel": _max_rel(grads, ref_grads)})
    plain, ckpt = (_run(draft, batch, device, torch.float32, K, checkpoint=c) for c in (False, True))
    rows.append({"check": f"checkpointed vs not on {device.type} (fp32)", "loss_rel": abs((ckpt[0] - plain[0]) / plain[0]).item(),
                 "grad_max_rel": _max_rel(ckpt[1], plain[1])})
    return rows


def check_sdpa_backends(device, cfg, T, K) -> list[dict]:
    """Step K-1 of the TTT attention (keys of K steps) fwd+bwd in bf16 under each SDPA backend alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    attn = Attention(cfg).to(device, torch.bfloat16)
    x = torch.randn(1, T, 2 * cfg.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    kv = cfg.num_key_value_heads, cfg.head_dim
    past = [(torch.randn(1, *kv[:1], T, kv[1], device=device, dtype=torch.bfloat16),
             torch.randn(1, *kv[:1], T, kv[1], device=device, dtype=torch.bfloat16)) for _ in range(K - 1)]
    pos = torch.arange(T, device=device)[None] + K - 1
    rows = []
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        name = "default" if backend is None else backend.name
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                out, _ = attn(x, pos, past)
                out.float().sum().backward()
            status = "ok"
        except RuntimeError as err:
            status = f"n/a: {str(err).splitlines()[0][:40]}"
        peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
        rows.append({"check": f"SDPA {name}, T={T}, keys {K}T", "status": status,
                     "peak_gib": None if peak is None else peak / GiB})
        x.grad = None
        attn.zero_grad(set_to_none=True)
    return rows


def check_offloaded_adamw(device, cfg_params: int, small: bool) -> list[dict]:
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)
    torch.manual_seed(0)
    ref = torch.nn.Linear(256, 128).to(device)
    off = torch.nn.Linear(256, 128).to(device)
    off.load_state_dict(ref.state_dict())
    o_ref, o_off = torch.optim.AdamW(ref.parameters(), **kw), OffloadedAdamW(off.parameters(), "cpu", **kw)
    for s in range(5):
        g = torch.Generator(device="cpu").manual_seed(s)
        x = torch.randn(16, 256, generator=g).to(device)
        for m, o in ((ref, o_ref), (off, o_off)):
            (m(x) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), off.parameters()))
    rows = [{"check": f"OffloadedAdamW (host) vs AdamW on {device.type}, 5 steps", "max_abs_diff": diff,
             "pinned": bool(o_off.masters[0].is_pinned()) if device.type == "cuda" else None}]
    # time of one step at the Kimi draft's size: grads in, fused host AdamW, weights out
    n = 4096 if small else cfg_params
    chunk = min(n, 1 << 27)
    params = [torch.zeros(min(chunk, n - i), device=device, requires_grad=True) for i in range(0, n, chunk)]
    opt = OffloadedAdamW(params, "cpu", **kw)
    times = []
    for _ in range(3):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rows.append({"check": f"OffloadedAdamW step, {n:,} params ({torch.get_num_threads()} host threads)",
                 "step_s": sorted(times)[1], "all_s": times})
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--seq-len", type=int, default=2048, help="T of the SDPA backend check (Kimi heads)")
    p.add_argument("--out", type=Path, default=None, help="folder of the JSON (default: $OUT, else benchmarks/results)")
    args = p.parse_args(argv)
    folder = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS)
    out = folder / ("gpu_trainer_checks_small.json" if args.small else "gpu_trainer_checks.json")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict] = []
    checks = (lambda: check_numerics(device, SMALL, 2, 24, 4),
              lambda: check_sdpa_backends(device, SMALL if args.small else KIMI, 32 if args.small else args.seq_len, 7),
              lambda: check_offloaded_adamw(device, 963_407_872, args.small))
    for check in checks:
        rows += check()
        write_json(out, {"machine": machine_info(), "rows": rows}, quiet=True)  # a run cut short keeps its rows
    cols = ["check", "loss_rel", "grad_max_rel", "status", "peak_gib", "max_abs_diff", "step_s"]
    fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    print_table("GPU trainer checks", cols, [[fmt(r.get(c)) for c in cols] for r in rows])
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
