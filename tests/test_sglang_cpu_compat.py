"""Each CPU workaround in specforge_k25/target/sglang_cpu_compat.py is still needed AND still works.

If SGLang (pinned 0.5.23) fixes one of these upstream, the "needed" test fails: delete the
workaround and its tests. If a version bump breaks one, the "works" test fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PY = sys.executable


def _run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env)


def test_sgl_kernel_stand_in_needed_and_working():
    # needed: no CPU build of sgl_kernel is importable, and SGLang's model runner imports it
    without = _run("import sglang.srt.model_executor.model_runner")
    assert without.returncode != 0 and "sgl_kernel" in without.stderr, without.stderr[-2000:]
    # works: with the stand-in the same import succeeds, and calling an op names it
    with_ = _run("""
        from specforge_k25.target import sglang_cpu_compat
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


def test_sglang_still_lacks_torch_native_mla_handler():
    """Needed: SGLang registers no DeepSeek attention handler for torch_native (falls back to triton's)."""
    out = _run("""
        from specforge_k25.target import sglang_cpu_compat
        sglang_cpu_compat.apply(mla_fix=False)
        from sglang.srt.models.deepseek_common import attention_backend_handler as h
        print("HAS_TORCH_NATIVE", "torch_native" in h.AttentionBackendRegistry._handlers)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HAS_TORCH_NATIVE False" in out.stdout


_CAPTURE_DIFF = """
    import sys, torch
    from specforge_k25.target import sglang_cpu_compat
    sglang_cpu_compat.apply(mla_fix={fix})
    from specforge_k25.target.sglang_engine import SGLangTarget
    from specforge_k25.target.hf_reference import HFTarget
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
    from specforge_k25.target.models import tiny_deepseek_config
    from specforge_k25.target.sglang_cpu_compat import check_deepseek_config

    check_deepseek_config(tiny_deepseek_config(100))
    with pytest.raises(ValueError, match="YaRN"):
        check_deepseek_config(tiny_deepseek_config(100, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    cfg = tiny_deepseek_config(100)
    cfg.moe_layer_freq = None
    with pytest.raises(ValueError, match="moe_layer_freq"):
        check_deepseek_config(cfg)
