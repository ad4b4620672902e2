"""The node probe reads the nvcc release as SGLang's JIT does and refuses one too old for the arch."""
from __future__ import annotations

import dataclasses

from specforge_k25.target_engine.node_probe import NodeProbe, nvcc_problem, nvcc_release

NVCC_12_6 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2024 NVIDIA Corporation
Built on Tue_Oct_29_23:50:19_PDT_2024
Cuda compilation tools, release 12.6, V12.6.85
Build cuda_12.6.r12.6/compiler.35059454_0
"""


def _fake_nvcc(folder, output: str) -> str:
    path = folder / "nvcc"
    path.write_text(f"#!/bin/sh\ncat <<'END'\n{output}END\n")
    path.chmod(0o755)
    return str(path)


def test_an_nvcc_older_than_the_arch_needs_is_refused(tmp_path):
    nvcc = _fake_nvcc(tmp_path, NVCC_12_6)
    assert nvcc_release(nvcc) == (12, 6)  # the fake binary run as the probe runs it
    probe = NodeProbe(nvcc=lambda: nvcc)
    for arch, need in (("sm120", "12.8"), ("sm100", "12.8"), ("sm103", "12.9")):
        assert nvcc_problem(probe, arch) == (f"{nvcc} is CUDA 12.6: compiling for {arch} needs nvcc >= {need} "
                                             f"(SGLang compiles for sm_{arch[2:]}a/f)")
    assert nvcc_problem(probe, "sm90") is None and nvcc_problem(probe, None) is None  # 12.0 enough; arch unknown
    newer = _fake_nvcc(tmp_path, NVCC_12_6.replace("12.6", "12.8"))
    probe = dataclasses.replace(probe, nvcc=lambda: newer)
    assert nvcc_problem(probe, "sm120") is None and nvcc_problem(probe, "sm100") is None
    assert "needs nvcc >= 12.9" in nvcc_problem(probe, "sm103")  # B300's sm_103a came with 12.9
    assert nvcc_release(_fake_nvcc(tmp_path, "nvcc: something else\n")) is None  # unreadable: not refused
    assert nvcc_problem(dataclasses.replace(probe, nvcc=lambda: str(tmp_path / "nvcc")), "sm120") is None
    assert nvcc_problem(dataclasses.replace(probe, nvcc=lambda: None), "sm120").startswith("no nvcc on this node")


def test_the_rtx_profile_is_refused_on_a_node_with_nvcc_12_6():
    from specforge_k25.config import compose_job
    from specforge_k25.plan import KIMI_K25
    from specforge_k25.plan.kernels import kernel_problems

    hw = compose_job(["+hw=rtxpro6000x8"]).hw  # sm120: Marlin, compiled on the node
    probe = NodeProbe(cuda_available=lambda: True, nvcc=lambda: "/opt/cuda/bin/nvcc", has_module=lambda name: True,
                      nvcc_version=lambda path: (12, 6), sgl_kernel_names=lambda: {"moe_sum_reduce", "scalar_type"})
    (problem,) = kernel_problems(hw, KIMI_K25, probe)
    assert problem.startswith("/opt/cuda/bin/nvcc is CUDA 12.6: compiling for sm120 needs nvcc >= 12.8"), problem
    assert kernel_problems(hw, KIMI_K25, dataclasses.replace(probe, nvcc_version=lambda path: (12, 8))) == []
