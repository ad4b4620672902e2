"""Workaround 5, target_engine/sglang_cpu_compat/gpu_image.py: sgl_kernel on CUDA without its wheel (a bare image).

SGLang's CUDA import paths run on this CPU machine once torch says CUDA is there (sglang's
utils.is_cuda: torch.cuda.is_available() and torch.version.cuda); nothing reaches a GPU.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
from compat_subprocess import run_cuda, sglang_source  # this folder is on sys.path (pytest's prepend import mode)


_GPU_IMPORTS = ("sglang.srt.model_executor.model_runner", "sglang.srt.layers.quantization.gguf",
                "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.layers.attention.triton_backend",
                "sglang.benchmark.one_batch", "sglang.srt.entrypoints.engine")


@pytest.mark.slow
def test_gpu_stand_in_needed():
    """sglang 0.5.23 on CUDA imports the three submodules and asserts the sglang-kernel package;
    its fused ops go to sgl_kernel unless forced to torch (see the works test); its default
    attention on Hopper is fa3, whose kernels come from sgl_kernel."""
    assert "from sgl_kernel.quantization import" in sglang_source("srt/layers/quantization/gguf.py")
    assert "from sgl_kernel.kvcacheio import" in sglang_source("srt/mem_cache/memory_pool_host.py")
    pdl = "from sgl_kernel.utils import is_arch_support_pdl"
    assert pdl in sglang_source("srt/layers/attention/triton_backend.py")
    engine = sglang_source("srt/entrypoints/engine.py")
    assert '"sglang-kernel",' in engine and "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK" in engine
    assert 'return "fa3"' in sglang_source("srt/arg_groups/model_override_base.py")
    assert "from sgl_kernel" in sglang_source("srt/layers/attention/flashattention_backend.py")
    # PathFinder sees installed packages only: an earlier test in this process may have put our stand-in
    # finder on sys.meta_path, which is not an installed sgl_kernel
    real = importlib.machinery.PathFinder.find_spec("sgl_kernel")
    assert real is None, "a real sgl_kernel is installed here: the test means nothing"
    without = run_cuda("import sglang.srt.model_executor.model_runner")
    assert without.returncode != 0 and "No module named 'sgl_kernel'" in without.stderr, without.stderr[-2000:]


_GPU_WORKS = """
    import os, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    print("APPLIED", sglang_cpu_compat.apply_gpu(), sglang_cpu_compat.apply_gpu())
    print("ENV", os.environ["SGLANG_FORCE_FUSED_OP_BACKEND"], os.environ["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"])
    for name in {imports}:
        __import__(name)
    import sgl_kernel.utils
    print("PDL", sgl_kernel.utils.is_arch_support_pdl())
    try:
        import sgl_kernel.scalar_type  # SGLang's guarded fallbacks must keep seeing ImportError
        print("SCALAR_TYPE found")
    except ImportError:
        print("SCALAR_TYPE missing")
    from sglang.srt.arg_groups import model_override_base, overrides
    print("DEFAULT", model_override_base.get_default_attn_backend(None, False, None),
          overrides.get_default_attn_backend(None, True, None))
    from sglang.kernels import fused_op
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope
    print("FORCED", fused_op.get_fused_op_backend().value)
    # SGLang's own torch paths (reached through the forced backend) vs float64
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    out, res = norm(x.clone(), r.clone())
    s = x.double() + r.double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    errs = [(out.double() - ref).abs().max(), (res.double() - s).abs().max()]
    h = torch.randn(5, 128, generator=g)
    silu_ref = torch.nn.functional.silu(h[:, :64].double()) * h[:, 64:].double()
    errs.append((SiluAndMul()(h).double() - silu_ref).abs().max())
    rope = get_rope(64, 64, 256, 10000.0, is_neox_style=True, dtype=torch.float32)
    pos = torch.tensor([0, 3, 7, 100, 255])
    q, k = torch.randn(5, 128, generator=g), torch.randn(5, 64, generator=g)
    q_out, k_out = rope(pos, q.clone(), k.clone())
    angle = pos.double()[:, None, None] * 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    for got, t in ((q_out, q), (k_out, k)):
        t = t.double().view(5, -1, 64)
        a, b = t[..., :32], t[..., 32:]
        want = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
        errs.append((got.double().view(5, -1, 64) - want).abs().max())
    print("ERRS", " ".join(f"{{float(e):.3g}}" for e in errs))
    fused_op.set_fused_op_backend(None)  # not forced: the CUDA path calls the stand-in, which says so
    try:
        RMSNorm(64)(x)
        print("UNFORCED ran")
    except NotImplementedError as e:
        print("UNFORCED raised", e)
"""


@pytest.mark.slow
def test_gpu_stand_in_works():
    out = run_cuda(_GPU_WORKS.format(imports=_GPU_IMPORTS))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["APPLIED"] == "True True" and lines["ENV"] == "torch 1", out.stdout
    assert lines["PDL"] == "False" and lines["SCALAR_TYPE"] == "missing", out.stdout
    assert lines["DEFAULT"] == "triton triton" and lines["FORCED"] == "torch", out.stdout
    rms, residual, silu, rope_q, rope_k = (float(e) for e in lines["ERRS"].split())
    assert max(rms, residual, silu) < 1e-5 and max(rope_q, rope_k) < 5e-5, lines["ERRS"]  # fp32 vs float64
    assert lines["UNFORCED"].startswith("raised sgl_kernel.rmsnorm"), out.stdout


def test_gpu_stand_in_only_without_the_real_package(tmp_path):
    """A real sgl_kernel (here: a package of that name) leaves the process untouched; and the CPU and
    GPU workarounds refuse to mix in one process."""
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("")
    out = run_cuda(f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from specforge_k25.target_engine import sglang_cpu_compat
        print("APPLIED", sglang_cpu_compat.apply_gpu(), os.environ.get("SGLANG_FORCE_FUSED_OP_BACKEND"))
        sys.path.pop(0)
        sglang_cpu_compat.apply()
        try:
            sglang_cpu_compat.apply_gpu()
        except RuntimeError as e:
            print("MIXED", e)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "APPLIED False None" in out.stdout and "MIXED" in out.stdout, out.stdout


# ------------------------------- 5a-c. what a bare CUDA image lacks past import time (LlamaMLP, graphs)
# On top of FAKE_CUDA: what SGLang's start-up reads of the device, a one-layer Llama folder and the
# published runtime context SGLang's layers read, so that its real CUDA code builds models on this CPU.
_CUDA_BUILD = """
    import sys, tempfile, types, torch
    from unittest import mock
    torch.cuda.mem_get_info = lambda *a, **k: (140 << 30, 141 << 30)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        total_memory=141 << 30, multi_processor_count=132, name="NVIDIA H200", major=9, minor=0)
    torch.cuda.current_device = lambda: 0
    from specforge_k25.target_engine import sglang_cpu_compat
    print("APPLIED", sglang_cpu_compat.apply_gpu({switches}))
    from transformers import LlamaConfig
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish
    folder = tempfile.mkdtemp()
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, architectures=["LlamaForCausalLM"])
    config.save_pretrained(folder)

    def graphs(**kw):
        server_args = ServerArgs(model_path=folder, device="cuda", **kw)
        server_args.resolve_once()
        graph = resolved_view(server_args).cuda_graph_config
        return graph.prefill.backend, graph.decode.backend

    print("GRAPHS", *graphs(), *graphs(cuda_graph_backend_prefill="breakable"))
    publish(ServerArgs(model_path=folder, device="cuda"), role="scheduler")
    get_parallel().override_permanently(pp_group=types.SimpleNamespace(is_first_rank=True, is_last_rank=True,
                                                                        world_size=1, rank_in_group=0))
    torch.set_default_dtype(torch.bfloat16)  # the dtype the fused dual GEMM would take
"""

_GPU_LAZY_NEEDED = _CUDA_BUILD + """
    # as on the image: cuda-bindings is installed there (not here), nvidia-cutlass-dsl is not
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        sys.modules[name] = mock.MagicMock(__path__=[])
    from sglang.srt.models.llama import LlamaMLP
    try:
        LlamaMLP(128, 256, "silu")
        print("MLP built")
    except ImportError as e:
        print("MLP", type(e).__name__, e)
    try:
        import sglang.srt.layers.attention.flashmla_backend
        print("FLASHMLA imported")
    except ImportError as e:
        print("FLASHMLA", type(e).__name__, e)
    from sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor import weak_ref_tensors
    try:
        weak_ref_tensors(torch.zeros(2))
        print("WEAKREF ran")
    except NotImplementedError as e:
        print("WEAKREF raised", e)
"""


@pytest.mark.slow
def test_gpu_lazy_imports_needed():
    """sglang 0.5.23 on CUDA: every LlamaMLP's DualGemm imports the cutlass kernel module; the EAGLE
    worker's graph set-up imports flashmla_backend (flash_mla); the prefill graph defaults to
    "breakable", whose capture keeps weak references through sgl_kernel.weak_ref_tensor."""
    dual_gemm = sglang_source("srt/layers/dual_gemm.py")
    assert "from sglang.kernels.ops.gemm.cutedsl_dual_gemm import" in dual_gemm and "is_cuda()" in dual_gemm
    assert "\nimport cutlass\n" in sglang_source("kernels/ops/gemm/cutedsl_dual_gemm.py")
    assert "DualGemm(self.gate_up_proj" in sglang_source("srt/models/llama.py")
    assert "flashmla_backend import FlashMLABackend" in sglang_source("srt/speculative/eagle_worker_v2.py")
    assert "\nimport flash_mla\n" in sglang_source("kernels/ops/attention/flash_mla_interface.py")
    assert "weak_ref_tensors" in sglang_source(
        "srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py")
    for missing in ("cutlass", "flash_mla"):
        assert importlib.util.find_spec(missing) is None, f"{missing} is installed here: the test means nothing"
    out = run_cuda(_GPU_LAZY_NEEDED.format(switches="dual_gemm=False, flashmla=False, prefill_graph=False"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["MLP"] == "ModuleNotFoundError No module named 'cutlass'", out.stdout
    assert lines["FLASHMLA"] == "ModuleNotFoundError No module named 'flash_mla'", out.stdout
    assert lines["GRAPHS"] == "breakable full breakable full", out.stdout
    assert lines["WEAKREF"].startswith("raised sgl_kernel.weak_ref_tensor"), out.stdout


_GPU_LAZY_WORKS = _CUDA_BUILD + """
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    target = LlamaForCausalLM(config)
    draft = LlamaForCausalLMEagle3(LlamaConfig(**{{**config.to_dict(), "draft_vocab_size": 32}}))
    print("MODES", *[m.dual_gemm.mode for model in (target, draft) for m in model.modules() if hasattr(m, "dual_gemm")])
    mlp = target.model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
        gate, up = (x.double() @ mlp.gate_up_proj.weight.double().t()).chunk(2, -1)
        ref = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.double().t()
        print("MLP_ERR", float(((mlp(x).double() - ref).norm() / ref.norm())))
    try:
        mlp.dual_gemm(x, mlp.gate_up_proj)
    except NotImplementedError as e:
        print("FUSED raised", e)
    import ast
    from pathlib import Path
    from sglang.srt.layers.attention import flashmla_backend
    names = set()
    for rel in ("srt/speculative/eagle_worker_v2.py", "srt/speculative/draft_utils.py",
                "srt/layers/attention/attention_registry.py"):
        tree = ast.parse(Path(sys.modules["sglang"].__path__[0], rel).read_text())
        names |= {{a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.module == flashmla_backend.__name__ for a in n.names}}
    print("FLASHMLA_NAMES", sorted(names), all(isinstance(getattr(flashmla_backend, n), type) for n in names),
          isinstance(mlp, tuple(getattr(flashmla_backend, n) for n in names)))
    try:
        flashmla_backend.FlashMLABackend(None)
    except NotImplementedError as e:
        print("FLASHMLA raised", e)
"""


@pytest.mark.slow
def test_gpu_lazy_imports_workarounds_work():
    """Built on CPU through SGLang's CUDA code: the target and the EAGLE-3 draft take the plain MLP path
    (equal to the float64 reference), the fused call says why it is missing; flashmla_backend is a
    stand-in that holds every name SGLang imports from it; the prefill graph is off unless asked for."""
    out = run_cuda(_GPU_LAZY_WORKS.format(switches=""))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["APPLIED"] == "True" and lines["MODES"] == "None None", out.stdout
    assert float(lines["MLP_ERR"]) < 1e-2, out.stdout  # bf16 against float64
    assert lines["FUSED"].startswith("raised the cutlass dual GEMM was called"), out.stdout
    assert lines["FLASHMLA_NAMES"] == "['FlashMLABackend', 'FlashMLAMultiStepDraftBackend'] True False", out.stdout
    assert lines["FLASHMLA"].startswith("raised FlashMLABackend needs flash_mla"), out.stdout
    assert lines["GRAPHS"] == "disabled full breakable full", out.stdout
