"""Workaround 8: an SGLang engine's scheduler and detokenizer forked on CPU, not spawned (SGLang
`SGLANG_VERSION`).

What SGLang does: `sglang.Engine` starts its scheduler and detokenizer processes with
multiprocessing's `spawn`, which `_set_envs_and_config` (srt/entrypoints/engine.py) forces for
every engine: a forked child cannot use its parent's CUDA context. A spawned child imports sglang,
torch and transformers again (~13 CPU seconds) before any work, twice per engine.
Why it matters here: on CPU there is no CUDA context to lose, and the process that starts the engine
(target_engine/sglang_spec.py's worker) has imported sglang, applied these workarounds and done
nothing else, so a fork is ready at once. The eval and the test suite start dozens of engines.
What it does: on CPU (`SGLANG_USE_CPU_ENGINE=1`, which apply() sets), `_set_envs_and_config` ends
with the start method `fork`; apply_gpu() never installs it.

Checked by `test_sglang_still_spawns_engine_subprocesses` and
`test_engine_subprocesses_are_forked_and_serve_as_spawned` in
tests/target_engine/sglang_cpu_compat/test_compat_fork_subprocesses.py.
"""
from __future__ import annotations

import functools
import multiprocessing
import os

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import patch_when_imported

ENGINE_MODULE = "sglang.srt.entrypoints.engine"


def _fork_on_cpu(module) -> None:
    original = module._set_envs_and_config

    @functools.wraps(original)
    def set_envs_and_config(*args, **kwargs):
        result = original(*args, **kwargs)
        if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
            multiprocessing.set_start_method("fork", force=True)
        return result

    module._set_envs_and_config = set_envs_and_config


def install() -> None:
    patch_when_imported(ENGINE_MODULE, _fork_on_cpu)
