"""What only a CUDA run of benchmarks/gpu_e2e.py measures: device memory against the plan, and
whether SGLang's JIT KV-store kernel builds on the image."""
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


def jit_preflight(rows_bytes: list[int]) -> dict:
    """CUDA: build SGLang's JIT KV-store kernel once in a child (its disk cache then serves the
    engines). A failure is not fatal (SGLang stores K/V with torch), but SGLang retries the build on
    every call, which can make the engine crawl: the line says so."""
    code = ("import time\nfrom specforge_k25.target import sglang_cpu_compat\nsglang_cpu_compat.apply_gpu()\n"
            "from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache\nt = time.perf_counter()\n"
            f"print('JIT', all(can_use_store_cache(b) for b in {rows_bytes}), round(time.perf_counter() - t, 1))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("JIT ")), "")
        return {"built": line.split()[1:2] == ["True"], "seconds": float(line.split()[2]) if line else None,
                "log": (out.stdout + out.stderr)[-1500:]}
    except subprocess.TimeoutExpired:
        return {"built": False, "seconds": None, "log": "timed out after 180 s"}
