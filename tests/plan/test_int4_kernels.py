"""INT4 experts in the plan (plan/kernels.py): which MoE kernels SGLang 0.5.23 runs them with per
GPU arch, the Marlin MoE scratch counted on a TP rank (its size is what SGLang's own fused_marlin_moe
allocates), and the node checks that refuse a run SGLang could not start.

Assumed: Kimi-K2.5's INT4 experts (KIMI_K25: compressed-tensors, 4 bits, group 32), top-8, expert
width 2048, hidden 7168; the RTX PRO 6000 is sm120 (Marlin), the B300 sm103 (FlashInfer trtllm).
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, PlanError, check_fits, plan_memory
from specforge_k25.target_engine import node_probe
from specforge_k25.plan.kernels import (MARLIN, TRTLLM, NodeProbe, int4_moe_backend, kernel_problems,
                                        marlin_scratch_bytes)

SCRATCH = "SGLang Marlin MoE scratch (INT4 experts)"
KIMI = ["target=kimi_k25", "draft=kimi"]


def _job(hw: str, *extra: str):
    return compose_job([f"+hw={hw}", *KIMI, *extra])


def test_marlin_scratch_is_what_sglangs_fused_marlin_moe_allocates(monkeypatch):
    """SGLang's fused_marlin_moe (the Python body of its custom op) run on CPU up to its first GEMM:
    the bf16 buffers it allocates are marlin_scratch_bytes of the batch (tiny shapes)."""
    from specforge_k25.target_engine import sglang_cpu_compat

    sglang_cpu_compat.apply()
    import sglang.srt.layers.moe.fused_moe_triton as moe_pkg
    from sglang.srt.layers.moe.fused_moe_triton import fused_marlin_moe as fm

    M, K, N, E, topk, tp = 5, 256, 64, 4, 2, 4  # N: one TP rank's expert width
    bf16, i32 = torch.bfloat16, torch.int32
    args = (torch.zeros(M, K, dtype=bf16), torch.zeros(E, K // 16, 4 * N, dtype=i32),
            torch.zeros(E, N // 16, 2 * K, dtype=i32), torch.zeros(E, K // 32, 2 * N, dtype=bf16),
            torch.zeros(E, N // 32, K, dtype=bf16), torch.zeros(M, E), torch.zeros(M, topk),
            torch.zeros(M, topk, dtype=i32))
    monkeypatch.setattr(moe_pkg, "moe_align_block_size", lambda *a, **k: (
        torch.zeros(16, dtype=i32), torch.zeros(2, dtype=i32), torch.zeros(1, dtype=i32)))
    monkeypatch.setattr(fm, "get_scalar_type", lambda *a, **k: None)
    allocated, empty = [], torch.empty

    def recording_empty(*size, **kwargs):
        t = empty(*size, **kwargs)
        allocated.append(t.numel() * t.element_size() if t.dtype == bf16 else 0)
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    body = getattr(fm.fused_marlin_moe, "op_func", None) or inspect.unwrap(fm.fused_marlin_moe)
    with pytest.raises(Exception):  # its CUDA GEMM comes next
        body(*args, workspace=torch.zeros(1, dtype=i32), num_bits=4)
    monkeypatch.setattr(torch, "empty", empty)
    facts = dataclasses.replace(KIMI_K25, hidden_size=K, moe_intermediate_size=N * tp, num_experts_per_tok=topk)
    assert sum(allocated) == marlin_scratch_bytes(facts, M, tp) == M * topk * (max(2 * N, K) + N) * 2
    # Kimi-K2.5 at TP8, the RTX batch of 8 x 2048 tokens: 1.95 GB
    assert marlin_scratch_bytes(KIMI_K25, 16384, 8) == 16384 * 8 * (7168 + 256) * 2 == 1_946_157_056


def test_marlin_scratch_is_counted_where_sglang_runs_marlin():
    """sm120 (the RTX profile) and an unknown arch: Marlin, its scratch on every TP rank for one
    extend (SGLang's 8192-token chunk of the 16384-token target batch); sm103 (B300): FlashInfer's
    trtllm MxInt4, not counted; unquantized experts or a CPU run: neither."""
    rtx = plan_memory(_job("rtxpro6000x8"), KIMI_K25)
    assert all(g.get(SCRATCH) == 1_946_157_056 // 2 for g in rtx.gpus)
    assert any("sm120" in n and "marlin" in n and "nvcc" in n for n in rtx.notes)
    dedicated = plan_memory(_job("rtxpro6000x8", "hw.trainer_layout=dedicated"), KIMI_K25)
    assert dedicated.gpu(5).get(SCRATCH) == marlin_scratch_bytes(KIMI_K25, 2048, 8)  # one trainer rank's batch
    assert plan_memory(_job("rtxpro6000x8", "hw.gpu_arch=null"), KIMI_K25).gpu(0).get(SCRATCH) == 1_946_157_056 // 2
    b300 = plan_memory(_job("b300x8"), KIMI_K25)
    assert not any(i.name == SCRATCH for g in b300.gpus for i in g.items)
    assert any("sm103" in n and "flashinfer_trtllm" in n and "flashinfer-cubin" in n for n in b300.notes)
    bf16_experts = dataclasses.replace(KIMI_K25, quant_method=None, expert_weight_bits=None)
    assert not any(i.name == SCRATCH for g in plan_memory(_job("rtxpro6000x8"), bf16_experts).gpus for i in g.items)
    hw = _job("rtxpro6000x8").hw
    assert int4_moe_backend(hw, KIMI_K25) == MARLIN
    assert int4_moe_backend(dataclasses.replace(hw, gpu_arch="sm100"), KIMI_K25) == TRTLLM
    assert int4_moe_backend(dataclasses.replace(hw, gpu_arch="sm90"), KIMI_K25) == MARLIN
    assert int4_moe_backend(dataclasses.replace(hw, device="cpu"), KIMI_K25) is None


def _node(**over) -> NodeProbe:
    """A CUDA node with everything installed, but for `over`."""
    fields = dict(cuda_available=lambda: True, nvcc=lambda: "/usr/local/cuda/bin/nvcc", has_module=lambda name: True,
                  sgl_kernel_names=lambda: {"moe_sum_reduce", "scalar_type", "fused_add_rmsnorm"},
                  cubin_status=lambda: "installed")
    fields.update(over)
    return NodeProbe(**fields)


def test_kernel_requirements_are_checked_on_the_node():
    rtx, b300 = _job("rtxpro6000x8").hw, _job("b300x8").hw
    assert kernel_problems(rtx, KIMI_K25, _node()) == [] and kernel_problems(b300, KIMI_K25, _node()) == []
    no_nvcc = kernel_problems(rtx, KIMI_K25, _node(nvcc=lambda: None))
    assert len(no_nvcc) == 1 and "nvcc" in no_nvcc[0] and "Marlin" in no_nvcc[0]
    stand_in = kernel_problems(rtx, KIMI_K25, _node(sgl_kernel_names=lambda: {"silu_and_mul"}))
    assert len(stand_in) == 1 and "moe_sum_reduce" in stand_in[0] and "scalar_type" in stand_in[0]
    assert "not installed" in kernel_problems(rtx, KIMI_K25, _node(sgl_kernel_names=lambda: None))[0]

    def broken():
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert "does not import" in kernel_problems(rtx, KIMI_K25, _node(sgl_kernel_names=broken))[0]
    # sm103: FlashInfer, and nvcc is not needed there
    assert kernel_problems(b300, KIMI_K25, _node(nvcc=lambda: None)) == []
    assert "flashinfer" in kernel_problems(b300, KIMI_K25, _node(has_module=lambda name: name != "flashinfer"))[0]
    # the dtype is checked anywhere; what is installed only on a CUDA machine
    fp32 = dataclasses.replace(rtx, target_dtype="float32")
    assert ["hw.target_dtype=float32" in p for p in kernel_problems(fp32, KIMI_K25, _node(cuda_available=lambda: False))] == [True]
    assert kernel_problems(dataclasses.replace(b300, target_dtype="float16"), KIMI_K25, _node())[0].startswith(
        "hw.target_dtype=float16")
    assert kernel_problems(dataclasses.replace(rtx, target_dtype="float16"), KIMI_K25, _node()) == []
    assert kernel_problems(rtx, KIMI_K25, _node(cuda_available=lambda: False, nvcc=lambda: None)) == []


def test_run_on_a_node_without_nvcc_is_refused(monkeypatch):
    """check_fits (what `train` runs before any process starts) refuses the RTX profile on a CUDA
    node without nvcc, and names it; the same plan on a machine without CUDA fits."""
    assert check_fits(_job("rtxpro6000x8"), KIMI_K25).fits
    monkeypatch.setattr(node_probe, "_cuda_available", lambda: True)
    monkeypatch.setattr(node_probe, "_nvcc", lambda: None)
    monkeypatch.setattr(node_probe, "_sgl_kernel_names", lambda: {"moe_sum_reduce", "scalar_type"})
    with pytest.raises(PlanError, match="no nvcc on this node"):
        check_fits(_job("rtxpro6000x8"), KIMI_K25)
    monkeypatch.setattr(node_probe, "_has_module", lambda name: True)
    monkeypatch.setattr(node_probe, "_cubin_status", lambda: "installed")
    check_fits(_job("b300x8"), KIMI_K25)  # FlashInfer's prebuilt kernels: no nvcc needed
