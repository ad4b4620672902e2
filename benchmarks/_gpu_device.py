"""What only a CUDA run of benchmarks/gpu_e2e.py measures: device memory against the plan, and
whether SGLang's JIT kernels (KV store, EAGLE tree) build on the image."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import torch

from specforge_k25.plan import facts_from_folder, plan_memory

ROOT = Path(__file__).resolve().parents[1]


class MemorySampler:
    """Peak device memory in use (all processes: cudaMemGetInfo) and per process (NVML, where the
    sandbox reports it), sampled every 20 ms in a thread of the trainer process."""

    def __init__(self):
        self.peak_used, self.per_pid, self._stop = 0, {}, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - NVML is optional
            self._nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.02):
            free, total = torch.cuda.mem_get_info()
            self.peak_used = max(self.peak_used, total - free)
            if self._nvml is not None:
                try:
                    for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                        if p.usedGpuMemory:
                            self.per_pid[p.pid] = max(self.per_pid.get(p.pid, 0), int(p.usedGpuMemory))
                except Exception:  # noqa: BLE001
                    self._nvml = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def memory_vs_plan(job, sampler: MemorySampler) -> dict:
    plan = plan_memory(job, facts_from_folder(job.target.path))
    gpu = plan.gpu(job.hw.target_gpu)
    own = {"target": 0, "stream": 0}
    for item in gpu.items:
        if item.owner in own:
            own[item.owner] += item.bytes
    trainer = gpu.total() - own["target"] - own["stream"]
    return {"device_peak_used": sampler.peak_used, "plan_total": gpu.total(), "plan_target": own["target"],
            "plan_trainer": trainer, "plan_ring": own["stream"], "per_process_peak_nvml": sampler.per_pid,
            "trainer_max_reserved": torch.cuda.max_memory_reserved(), "mem_fraction_static": job.hw.mem_fraction_static,
            "ok": sampler.peak_used <= gpu.total()}


# Each runs in a child with sglang_cpu_compat.apply_gpu(), as the engines do; SGLang's JIT disk cache
# then serves the engines. The code prints one line "BUILT <seconds>".
_KV_STORE = """
from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache
assert all(can_use_store_cache(b) for b in {rows}), "can_use_store_cache said no (the build failed)"
"""
# spec_tree.py calls these two on CUDA, compiled with nvcc/ninja through tvm-ffi, with no fallback
_TREE = """
from sglang.kernels.ops.speculative.tree import _jit_tree_module
module = _jit_tree_module()
assert module.build_tree_kernel_efficient is not None and module.verify_tree_greedy is not None
"""


def _build(code: str, timeout_s: int) -> dict:
    script = ("import time\nfrom specforge_k25.target_engine import sglang_cpu_compat\nsglang_cpu_compat.apply_gpu()\n"
              "t = time.perf_counter()\n" + code + "print('BUILT', round(time.perf_counter() - t, 1))\n")
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s,
                             cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        return {"built": False, "seconds": None, "log": f"timed out after {timeout_s} s\n{err.stdout or ''}"
                                                      f"{err.stderr or ''}"[-4000:]}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BUILT ")), "")
    return {"built": out.returncode == 0 and bool(line), "seconds": float(line.split()[1]) if line else None,
            "log": (out.stdout + out.stderr)[-4000:]}


def jit_preflight(rows_bytes: list[int], tree: bool) -> dict:
    """CUDA: build SGLang's JIT kernels once before the engines. The KV-store kernel may fail (SGLang
    stores K/V with torch, but retries the build on every call, which can make the engine crawl); the
    EAGLE tree kernels (check d) have no fallback. Each result keeps the build log's tail."""
    out = {"kv_store": _build(_KV_STORE.format(rows=rows_bytes), 300)}
    if tree:
        out["eagle_tree"] = _build(_TREE, 300)
    return out
