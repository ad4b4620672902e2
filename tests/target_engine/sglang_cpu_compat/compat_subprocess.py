"""What the tests of specforge_k25/target_engine/sglang_cpu_compat/ share: SGLang in a fresh
process, on CPU or through its CUDA code paths on this CPU machine, and SGLang's own source.

Each workaround module has its test file here (test_compat_<module>.py). If SGLang (pinned: the
package's SGLANG_VERSION) fixes one of them upstream, the "needed" test fails: delete the workaround
and its tests. If a version bump breaks one, the "works" test fails.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

PY = sys.executable


def run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env)


# SGLang's CUDA import paths run on this CPU machine once torch says CUDA is there (sglang's
# utils.is_cuda: torch.cuda.is_available() and torch.version.cuda); nothing reaches a GPU.
FAKE_CUDA = """
    import torch
    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.device_count = lambda: 1
"""


def run_cuda(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "SPECFORGE_SGLANG"))}
    return subprocess.run([PY, "-c", textwrap.dedent(FAKE_CUDA) + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONWARNINGS": "ignore"})


def sglang_source(relative: str) -> str:
    from pathlib import Path

    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0], relative).read_text()
