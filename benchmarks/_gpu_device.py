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


# The plan must hold what was measured and not overstate it by more than 2x: an upper bound that
# any overestimate would pass says nothing.
MEMORY_BOUNDS = (0.5, 1.0)  # measured / planned, per owner and in total


def owner_rows(planned: dict[str, int], measured: dict[str, int | None], bounds=MEMORY_BOUNDS) -> dict:
    """{owner: {planned, measured, ratio, ok}}: ok when bounds[0] <= measured / planned <= bounds[1];
    an owner not measured is None (not ok, not failed)."""
    rows = {}
    for owner, plan in planned.items():
        got = measured.get(owner)
        ratio = got / plan if got is not None and plan else None
        rows[owner] = {"planned": plan, "measured": got, "ratio": ratio,
                       "ok": None if ratio is None else bool(bounds[0] <= ratio <= bounds[1])}
    return rows


def memory_vs_plan(job, sampler: MemorySampler, trainer_pid: int) -> dict:
    """Measured / planned per owner: the trainer process (the trainer's items and the slot ring, which
    the trainer process allocates and shares with the target by CUDA IPC; NVML's figure includes its
    CUDA context), the target processes (SGLang, NVML: every other process on the GPU), and the whole
    device (cudaMemGetInfo). Without NVML per-process figures the trainer is torch's max reserved
    (no context) and the target the device peak less that."""
    plan = plan_memory(job, facts_from_folder(job.target.path))
    gpu = plan.gpu(job.hw.target_gpu)
    own = {"target": 0, "stream": 0}
    for item in gpu.items:
        if item.owner in own:
            own[item.owner] += item.bytes
    trainer_plan = gpu.total() - own["target"] - own["stream"]
    reserved = torch.cuda.max_memory_reserved()
    if sampler.per_pid:
        trainer = sampler.per_pid.get(trainer_pid)
        target = sum(v for pid, v in sampler.per_pid.items() if pid != trainer_pid) or None
        source = "NVML per process (peaks)"
    else:
        trainer, target = reserved, max(sampler.peak_used - reserved, 0)
        source = "no NVML per process: trainer = torch max reserved (no CUDA context), target = device peak - that"
    planned = {"trainer process (trainer + ring)": trainer_plan + own["stream"], "target processes": own["target"],
               "device total": gpu.total()}
    rows = owner_rows(planned, {"trainer process (trainer + ring)": trainer, "target processes": target,
                                "device total": sampler.peak_used})
    return {"owners": rows, "bounds": MEMORY_BOUNDS, "source": source, "device_peak_used": sampler.peak_used,
            "plan_total": gpu.total(), "plan_target": own["target"], "plan_trainer": trainer_plan,
            "plan_ring": own["stream"], "per_process_peak_nvml": sampler.per_pid, "trainer_max_reserved": reserved,
            "mem_fraction_static": job.hw.mem_fraction_static,
            "ok": all(r["ok"] is not False for r in rows.values()) and rows["device total"]["ok"] is True}


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


# On a CPU machine with nvcc: what SGLang reads to pick its CUDA paths says an H200 (capability 9.0), so
# the JIT compiles for sm_90a exactly as on the device (the build and the link, not the run)
FAKE_H200 = """
import torch
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
"""


def _build(code: str, timeout_s: int, prelude: str = "", env: dict | None = None) -> dict:
    script = (prelude + "import time\nfrom specforge_k25.target_engine import sglang_cpu_compat\n"
              "sglang_cpu_compat.apply_gpu()\nt = time.perf_counter()\n" + code
              + "print('BUILT', round(time.perf_counter() - t, 1))\n")
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s,
                             cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as err:
        return {"built": False, "seconds": None, "log": f"timed out after {timeout_s} s\n{err.stdout or ''}"
                                                      f"{err.stderr or ''}"[-4000:]}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BUILT ")), "")
    return {"built": out.returncode == 0 and bool(line), "seconds": float(line.split()[1]) if line else None,
            "log": (out.stdout + out.stderr)[-4000:]}


def jit_compile_on_cpu(rows_bytes: list[int], cache_dir: str, timeout_s: int = 300) -> dict:
    """The same builds on a CPU machine with nvcc, for an H200 (FAKE_H200), into an empty JIT cache
    (`cache_dir`: a cached build would prove nothing)."""
    import os

    env = {**os.environ, "SGLANG_JIT_CACHE_DIR": cache_dir}
    return {"kv_store": _build(_KV_STORE.format(rows=rows_bytes), timeout_s, FAKE_H200, env),
            "eagle_tree": _build(_TREE, timeout_s, FAKE_H200, env)}


def jit_preflight(rows_bytes: list[int], tree: bool, timeout_s: int = 150) -> dict:
    """CUDA: build SGLang's JIT kernels once before the engines. The KV-store kernel may fail (SGLang
    stores K/V with torch, but retries the build on every call, which can make the engine crawl); the
    EAGLE tree kernels (check d) have no fallback. Each result keeps the build log's tail."""
    out = {"kv_store": _build(_KV_STORE.format(rows=rows_bytes), timeout_s)}
    if tree:
        out["eagle_tree"] = _build(_TREE, timeout_s)
    return out
