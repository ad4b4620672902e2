"""Workaround 2, target_engine/sglang_cpu_compat/mla_torch_native.py: torch_native -> MLA for DeepSeek attention."""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
from compat_subprocess import PY, run  # this folder is on sys.path (pytest's default prepend import mode)


@pytest.mark.slow
def test_sglang_still_lacks_torch_native_mla_handler():
    """Needed: SGLang registers no DeepSeek attention handler for torch_native (falls back to triton's)."""
    out = run("""
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
