"""Each workaround in specforge_k25/target_engine/sglang_cpu_compat.py (CPU, and the GPU stand-in for
sgl_kernel) is still needed AND still works.

If SGLang (pinned 0.5.23) fixes one of these upstream, the "needed" test fails: delete the
workaround and its tests. If a version bump breaks one, the "works" test fails.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

PY = sys.executable


def _run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_sgl_kernel_stand_in_needed_and_working():
    # needed: no CPU build of sgl_kernel is importable, and SGLang's model runner imports it
    without = _run("import sglang.srt.model_executor.model_runner")
    assert without.returncode != 0 and "sgl_kernel" in without.stderr, without.stderr[-2000:]
    # works: with the stand-in the same import succeeds, and calling an op names it
    with_ = _run("""
        from specforge_k25.target_engine import sglang_cpu_compat
        sglang_cpu_compat.apply()
        import sglang.srt.model_executor.model_runner
        import sgl_kernel
        try:
            sgl_kernel.fused_add_rmsnorm(None)
        except NotImplementedError as e:
            print("RAISED", e)
    """)
    assert with_.returncode == 0, with_.stderr[-3000:]
    assert "RAISED" in with_.stdout and "fused_add_rmsnorm" in with_.stdout


@pytest.mark.slow
def test_sglang_still_lacks_torch_native_mla_handler():
    """Needed: SGLang registers no DeepSeek attention handler for torch_native (falls back to triton's)."""
    out = _run("""
        from specforge_k25.target_engine import sglang_cpu_compat
        sglang_cpu_compat.apply(mla_fix=False)
        from sglang.srt.models.deepseek_common import attention_backend_handler as h
        print("HAS_TORCH_NATIVE", "torch_native" in h.AttentionBackendRegistry._handlers)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HAS_TORCH_NATIVE False" in out.stdout


_CAPTURE_DIFF = """
    import sys, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply(mla_fix={fix})
    from specforge_k25.target_engine.sglang_engine import SGLangTarget
    from specforge_k25.target_engine.hf_reference import HFTarget
    path = sys.argv[1]
    seq = [torch.randint(3, 40000, (19,), generator=torch.Generator().manual_seed(0))]
    got = SGLangTarget(path, "DeepseekV3ForCausalLM", [2, 4, 5], num_threads=2).forward(seq)
    ref = HFTarget(path, [2, 4, 5]).forward(seq)
    print("DIFF", max((got.aux_hidden - ref.aux_hidden).abs().max().item(),
                      (got.final_hidden - ref.final_hidden).abs().max().item()))
"""


@pytest.mark.engine
def test_mla_fix_needed_and_working(tiny_deepseek_path):
    diffs = {}
    for fix in (False, True):
        out = subprocess.run([PY, "-c", textwrap.dedent(_CAPTURE_DIFF.format(fix=fix)), tiny_deepseek_path],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-3000:]
        diffs[fix] = float(out.stdout.split("DIFF")[-1])
    assert diffs[False] > 1e-2, f"without the fix SGLang now matches HF ({diffs[False]:.3g}): drop the workaround"
    assert diffs[True] <= 1e-4, f"with the fix SGLang differs from HF by {diffs[True]:.3g}"


def test_deepseek_config_check():
    from specforge_k25.target_engine.models import tiny_deepseek_config
    from specforge_k25.target_engine.sglang_cpu_compat import check_deepseek_config

    check_deepseek_config(tiny_deepseek_config(100))
    with pytest.raises(ValueError, match="YaRN"):
        check_deepseek_config(tiny_deepseek_config(100, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    cfg = tiny_deepseek_config(100)
    cfg.moe_layer_freq = None
    with pytest.raises(ValueError, match="moe_layer_freq"):
        check_deepseek_config(cfg)


# ------------------------------------------------------------------ 4. speculative decoding
@pytest.mark.slow
def test_spec_ops_equal_sglang_triton_kernels():
    """Our pure-torch `*_cpu` ops against SGLang's own Triton kernels, run by the Triton
    interpreter on CPU, on random cases (trees with topk 1-3 included)."""
    script = os.path.join(os.path.dirname(__file__), "..", "fixtures", "spec_ops_vs_triton.py")
    out = subprocess.run([PY, script, "12"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    mismatches = json.loads(out.stdout.split("MISMATCHES")[-1])
    assert len(mismatches) == 7 and all(v == 0 for v in mismatches.values()), mismatches


_SPEC_PATCHES = """
    import types, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply(spec_patches={patched})
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    # (a) the draft-decode backend factory and torch_native (as configured by --attention-backend)
    import sglang.srt.speculative.draft_utils as draft_utils
    draft_utils.attention_backends = lambda: ("torch_native", "torch_native")
    runner = types.SimpleNamespace(device="cpu", model_config=types.SimpleNamespace(hf_config=None),
                                   req_to_token_pool=None, token_to_kv_pool=None)
    factory = object.__new__(DraftBackendFactory)
    factory.draft_model_runner, factory.topk, factory.speculative_num_steps = runner, 1, 3
    factory.qsa_profile, factory.draft_attn_backend = None, None
    try:
        backend = factory.create_decode_backend()
        print("FACTORY", type(backend).__name__, len(backend.attn_backends))
    except Exception as e:
        print("FACTORY-ERROR", type(e).__name__, e)

    # (b) TARGET_VERIFY through torch_native's extend path: 2 requests, verified prefixes 5 and 3,
    # 4 chain tokens each, GQA 4 query / 2 kv heads. Reference: SDPA with the chain (= causal) mask.
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd, dtn = 4, 2, 8, 4
    prefix = torch.tensor([5, 3])
    req_to_token = torch.full((3, 16), -1, dtype=torch.int64)
    req_to_token[2, :9] = torch.arange(9)        # request 0 -> pool rows 0..8
    req_to_token[0, :7] = torch.arange(9, 16)    # request 1 -> pool rows 9..15
    k_buf, v_buf = torch.randn(16, nkv, hd, generator=g), torch.randn(16, nkv, hd, generator=g)
    class Pool:
        def set_kv_buffer(self, layer, loc, k, v):
            k_buf[loc.loc], v_buf[loc.loc] = k.view(-1, nkv, hd), v.view(-1, nkv, hd)
        def get_key_buffer(self, i): return k_buf
        def get_value_buffer(self, i): return v_buf
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                   token_to_kv_pool=Pool())
    layer = types.SimpleNamespace(qk_head_dim=hd, v_head_dim=hd, tp_q_head_num=nh, tp_k_head_num=nkv, layer_id=0,
                                  is_cross_attention=False, attn_type=AttentionType.DECODER, scaling=hd ** -0.5,
                                  sliding_window_size=None)
    out_loc = torch.cat([torch.arange(5, 9), torch.arange(12, 16)])
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([2, 0]),
                                  seq_lens=prefix.clone(), extend_prefix_lens=None, extend_seq_lens=None,
                                  encoder_lens=None, out_cache_loc=out_loc,
                                  spec_info=types.SimpleNamespace(topk=1, draft_token_num=dtn))
    q = torch.randn(2 * dtn, nh * hd, generator=g)
    k, v = torch.randn(2 * dtn, nkv * hd, generator=g), torch.randn(2 * dtn, nkv * hd, generator=g)
    backend = TorchNativeAttnBackend(runner)
    try:
        got = backend.forward_extend(q, k, v, layer, batch).view(2 * dtn, nh, hd)
    except Exception as e:
        print("VERIFY-ERROR", type(e).__name__, e)
    else:
        rows = [torch.arange(9), torch.arange(9, 16)]
        worst = 0.0
        for r, (p, kv_rows) in enumerate(zip(prefix.tolist(), rows)):
            qr = q[r * dtn:(r + 1) * dtn].view(dtn, nh, hd).transpose(0, 1)                # [nh, dtn, hd]
            kr = k_buf[kv_rows].repeat_interleave(nh // nkv, 1).transpose(0, 1)           # [nh, p+dtn, hd]
            vr = v_buf[kv_rows].repeat_interleave(nh // nkv, 1).transpose(0, 1)
            visible = torch.arange(p + dtn)[None] <= (p + torch.arange(dtn))[:, None]       # prefix + chain so far
            w = torch.softmax((qr @ kr.transpose(1, 2)) * hd ** -0.5 + torch.where(visible, 0.0, float("-inf")), -1)
            worst = max(worst, (got[r * dtn:(r + 1) * dtn] - (w @ vr).transpose(0, 1)).abs().max().item())
        print("VERIFY-DIFF", worst, "SEQ_LENS_RESTORED", torch.equal(batch.seq_lens, prefix))
"""


@pytest.mark.slow
def test_spec_patches_needed_and_working():
    without = _run(_SPEC_PATCHES.format(patched=False))
    assert without.returncode == 0, without.stderr[-3000:]
    assert "FACTORY-ERROR ValueError" in without.stdout and "torch_native" in without.stdout, without.stdout
    assert "VERIFY-ERROR" in without.stdout, f"SGLang's torch_native now handles TARGET_VERIFY: {without.stdout}"
    with_ = _run(_SPEC_PATCHES.format(patched=True))
    assert with_.returncode == 0, with_.stderr[-3000:]
    assert "FACTORY ChainDraftBackends 2" in with_.stdout, with_.stdout
    diff = float(with_.stdout.split("VERIFY-DIFF")[-1].split()[0])
    assert diff < 1e-5 and "SEQ_LENS_RESTORED True" in with_.stdout, with_.stdout


# ------------------------------------------------------------- 6. the MLA draft's embedding hand-over
_MLA_DRAFT = """
    import types, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply()
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM as Draft
    sync, empty = torch.cuda.synchronize, torch.cuda.empty_cache
    print("CUDA", torch.cuda.is_available())
    for name in ("set_embed", "set_embed_and_head"):  # the two ways the EAGLE worker hands the target's over
        for kind, method in (("SGLANG", getattr(Draft, name).__wrapped__), ("PATCHED", getattr(Draft, name))):
            draft = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=8, target_hidden_size=None),
                                          model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(4, 8)),
                                          lm_head=torch.nn.Linear(8, 4, bias=False))
            embed, head = torch.randn(4, 8), torch.randn(4, 8)
            try:
                method(draft, *((embed,) if name == "set_embed" else (embed, head)))
            except Exception as e:
                print(kind, name, "error", type(e).__name__, str(e).splitlines()[0])
            else:
                print(kind, name, "ok", draft.model.embed_tokens.weight is embed,
                      name == "set_embed" or draft.lm_head.weight is head)
    print("RESTORED", torch.cuda.synchronize is sync and torch.cuda.empty_cache is empty)
"""


@pytest.mark.slow
def test_mla_draft_set_embed_needed_and_working():
    """Needed: SGLang's MLA draft takes over the target's embedding (and head), then calls
    torch.cuda.synchronize, which CPU torch refuses. Works: patched, both take the target's
    tensors, and torch.cuda is left as it was. (SGLang's own method is the patch's `__wrapped__`.)"""
    out = _run(_MLA_DRAFT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CUDA False" in out.stdout, out.stdout
    for name in ("set_embed", "set_embed_and_head"):
        assert f"SGLANG {name} error" in out.stdout, f"SGLang's {name} now runs on CPU: drop workaround 6\n{out.stdout}"
        assert f"PATCHED {name} ok True True" in out.stdout, out.stdout
    assert "RESTORED True" in out.stdout, out.stdout


# ------------------------------------------------------- 5. sgl_kernel on CUDA without its wheel
# SGLang's CUDA import paths run on this CPU machine once torch says CUDA is there (sglang's
# utils.is_cuda: torch.cuda.is_available() and torch.version.cuda); nothing reaches a GPU.
_FAKE_CUDA = """
    import torch
    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.device_count = lambda: 1
"""
_GPU_IMPORTS = ("sglang.srt.model_executor.model_runner", "sglang.srt.layers.quantization.gguf",
                "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.layers.attention.triton_backend",
                "sglang.benchmark.one_batch", "sglang.srt.entrypoints.engine")


def _run_cuda(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "SPECFORGE_SGLANG"))}
    return subprocess.run([PY, "-c", textwrap.dedent(_FAKE_CUDA) + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONWARNINGS": "ignore"})


def _sglang_source(relative: str) -> str:
    from pathlib import Path

    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0], relative).read_text()


@pytest.mark.slow
def test_gpu_stand_in_needed():
    """sglang 0.5.23 on CUDA imports the three submodules and asserts the sglang-kernel package;
    its fused ops go to sgl_kernel unless forced to torch (see the works test); its default
    attention on Hopper is fa3, whose kernels come from sgl_kernel."""
    assert "from sgl_kernel.quantization import" in _sglang_source("srt/layers/quantization/gguf.py")
    assert "from sgl_kernel.kvcacheio import" in _sglang_source("srt/mem_cache/memory_pool_host.py")
    pdl = "from sgl_kernel.utils import is_arch_support_pdl"
    assert pdl in _sglang_source("srt/layers/attention/triton_backend.py")
    engine = _sglang_source("srt/entrypoints/engine.py")
    assert '"sglang-kernel",' in engine and "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK" in engine
    assert 'return "fa3"' in _sglang_source("srt/arg_groups/model_override_base.py")
    assert "from sgl_kernel" in _sglang_source("srt/layers/attention/flashattention_backend.py")
    # PathFinder sees installed packages only: an earlier test in this process may have put our stand-in
    # finder on sys.meta_path, which is not an installed sgl_kernel
    real = importlib.machinery.PathFinder.find_spec("sgl_kernel")
    assert real is None, "a real sgl_kernel is installed here: the test means nothing"
    without = _run_cuda("import sglang.srt.model_executor.model_runner")
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
    out = _run_cuda(_GPU_WORKS.format(imports=_GPU_IMPORTS))
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
    out = _run_cuda(f"""
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
# On top of _FAKE_CUDA: what SGLang's start-up reads of the device, a one-layer Llama folder and the
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
    dual_gemm = _sglang_source("srt/layers/dual_gemm.py")
    assert "from sglang.kernels.ops.gemm.cutedsl_dual_gemm import" in dual_gemm and "is_cuda()" in dual_gemm
    assert "\nimport cutlass\n" in _sglang_source("kernels/ops/gemm/cutedsl_dual_gemm.py")
    assert "DualGemm(self.gate_up_proj" in _sglang_source("srt/models/llama.py")
    assert "flashmla_backend import FlashMLABackend" in _sglang_source("srt/speculative/eagle_worker_v2.py")
    assert "\nimport flash_mla\n" in _sglang_source("kernels/ops/attention/flash_mla_interface.py")
    assert "weak_ref_tensors" in _sglang_source(
        "srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py")
    for missing in ("cutlass", "flash_mla"):
        assert importlib.util.find_spec(missing) is None, f"{missing} is installed here: the test means nothing"
    out = _run_cuda(_GPU_LAZY_NEEDED.format(switches="dual_gemm=False, flashmla=False, prefill_graph=False"))
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
    out = _run_cuda(_GPU_LAZY_WORKS.format(switches=""))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["APPLIED"] == "True" and lines["MODES"] == "None None", out.stdout
    assert float(lines["MLP_ERR"]) < 1e-2, out.stdout  # bf16 against float64
    assert lines["FUSED"].startswith("raised the cutlass dual GEMM was called"), out.stdout
    assert lines["FLASHMLA_NAMES"] == "['FlashMLABackend', 'FlashMLAMultiStepDraftBackend'] True False", out.stdout
    assert lines["FLASHMLA"].startswith("raised FlashMLABackend needs flash_mla"), out.stdout
    assert lines["GRAPHS"] == "disabled full breakable full", out.stdout


# ------------------------------------------------------------------ 7. DFLASH on CPU
_DFLASH = """
    import ast, inspect, sys, types, torch
    from specforge_k25.target_engine import sglang_cpu_compat as compat
    compat.apply()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.arg_groups import choices, speculative_hook as hook
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    def resolve():  # 7a, 7b: the engine's argument resolution of DFLASH on cpu
        args = ServerArgs(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                          disable_cuda_graph=True, speculative_algorithm="DFLASH",
                          speculative_draft_model_path=sys.argv[2], speculative_num_draft_tokens=4)
        try:
            args.resolve_once()
        except ValueError as e:
            return "error " + str(e).splitlines()[0]
        view = resolved_view(args)
        return f"ok {view.speculative_draft_attention_backend} {view.speculative_num_draft_tokens} {view.device}"

    patched, hook._handle_dflash = hook._handle_dflash, hook._handle_dflash.__wrapped__
    print("RESOLVE_SGLANG", resolve())
    hook._handle_dflash = patched
    print("RESOLVE_PATCHED", resolve())
    shipped = next(node.value for node in ast.walk(ast.parse(inspect.getsource(choices)))
                   if isinstance(node, ast.Assign) and node.targets[0].id == "DRAFT_ATTENTION_BACKEND_CHOICES")
    print("CHOICES", "torch_native" in ast.literal_eval(shipped), "torch_native" in choices.DRAFT_ATTENTION_BACKEND_CHOICES)

    cpu_stream = torch.get_device_module("cpu").current_stream()  # 7c
    try:
        torch.zeros(2).record_stream(cpu_stream)
        print("RECORD_STREAM ok")
    except RuntimeError as e:
        print("RECORD_STREAM error", e)
    original = torch.Tensor.record_stream
    with compat.record_stream_on_cpu():
        torch.zeros(2).record_stream(cpu_stream)
    source = inspect.getsource(DFlashWorkerV2.forward_batch_generation.__wrapped__)
    print("RECORD_STREAM_PATCHED", "batch.seq_lens.record_stream(" in source, torch.Tensor.record_stream is original)

    runner = types.SimpleNamespace(_pp_kwargs=lambda proxy: {}, is_generation=True,  # 7d
                                   model=types.SimpleNamespace(get_input_embeddings=lambda: None))
    embeds = torch.randn(3, 4)
    for kind, method in (("SGLANG", ModelRunner._extend_forward_kwargs.__wrapped__),
                         ("PATCHED", ModelRunner._extend_forward_kwargs)):
        batch = types.SimpleNamespace(input_embeds=embeds, replace_embeds=None, replace_positions=None)
        print("EMBEDS_" + kind, method(runner, batch, None)["input_embeds"] is embeds,
              method(runner, batch, None)["input_embeds"].dtype)
"""


@pytest.mark.slow
def test_dflash_on_cpu_needed_and_working(smollm2_path, tmp_path):
    """Workaround 7 against SGLang's own functions (each patch's `__wrapped__`, the shipped choices
    list): needed, SGLang refuses DFLASH on cpu, has no torch_native draft backend, record_stream
    raises on a CPU tensor, input_embeds become bf16; works, DFLASH resolves on cpu with a
    torch_native draft block of 4 and the fp32 embeddings pass as they are. That a DFLASH engine
    then serves a head correctly: tests/eval/test_eval_dflash.py."""
    import torch

    from specforge_k25.draft.dflash.method import DFlashMethod
    from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
    from specforge_k25.draft.export_folder import publish_folder

    method = DFlashMethod()
    draft = DFlashDraft(DFlashConfig(hidden_size=576, intermediate_size=8, num_hidden_layers=1, num_attention_heads=9,
                                     num_key_value_heads=3, head_dim=64, vocab_size=49152, target_hidden_size=576,
                                     num_aux_hidden_states=1, block_size=4, mask_token_id=49151))
    config = method.serving_config(draft.cfg, sglang_layer_ids=[], vllm_layer_ids=[2], bos_token_id=1, eos_token_id=2,
                                   dtype="float32")
    export = publish_folder(tmp_path / "dflash", method.serving_tensors(draft, torch.float32), config,
                            method.validate_export)
    out = subprocess.run([PY, "-c", textwrap.dedent(_DFLASH), smollm2_path, str(export)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["RESOLVE_SGLANG"] == "error DFLASH speculative decoding is not supported by CpuSRTPlatform on device 'cpu'.", out.stdout
    assert lines["RESOLVE_PATCHED"] == "ok torch_native 4 cpu", out.stdout
    assert lines["CHOICES"] == "False True", out.stdout
    assert lines["RECORD_STREAM"].startswith("error"), out.stdout
    assert lines["RECORD_STREAM_PATCHED"] == "True True", out.stdout
    assert lines["EMBEDS_SGLANG"] == "False torch.bfloat16" and lines["EMBEDS_PATCHED"] == "True torch.float32", out.stdout
