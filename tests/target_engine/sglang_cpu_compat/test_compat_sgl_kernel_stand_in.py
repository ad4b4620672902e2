"""Workaround 1, target_engine/sglang_cpu_compat/sgl_kernel_stand_in.py: a stand-in `sgl_kernel` on CPU."""
from __future__ import annotations

import pytest
from compat_subprocess import run  # this folder is on sys.path (pytest's default prepend import mode)


@pytest.mark.slow
def test_sgl_kernel_stand_in_needed_and_working():
    # needed: no CPU build of sgl_kernel is importable, and SGLang's model runner imports it
    without = run("import sglang.srt.model_executor.model_runner")
    assert without.returncode != 0 and "sgl_kernel" in without.stderr, without.stderr[-2000:]
    # works: with the stand-in the same import succeeds, and calling an op names it
    with_ = run("""
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
