"""Workaround 4, target_engine/sglang_cpu_compat/spec_ops.py: the `sgl_kernel.*_cpu` ops of EAGLE-3 decoding."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from compat_subprocess import PY  # this folder is on sys.path (pytest's default prepend import mode)


@pytest.mark.slow
def test_spec_ops_equal_sglang_triton_kernels():
    """Our pure-torch `*_cpu` ops against SGLang's own Triton kernels, run by the Triton
    interpreter on CPU, on random cases (trees with topk 1-3 included)."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures",
                          "spec_ops_vs_triton.py")
    out = subprocess.run([PY, script, "12"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    mismatches = json.loads(out.stdout.split("MISMATCHES")[-1])
    assert len(mismatches) == 7 and all(v == 0 for v in mismatches.values()), mismatches
