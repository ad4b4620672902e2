"""The device memory when the stream starts, beside the plan's figures for the same run.

Called once, when the first batch reaches the trainer (the target has loaded its weights and sized
its KV pool by then): what this trainer process holds (torch.cuda.memory_allocated) and what its
caching allocator keeps (memory_reserved), the device's free memory now (torch.cuda.mem_get_info),
and what plan/budget.py counted for this run: the free memory SGLang should measure before loading
(`free_before_load`), the KV pool in tokens, the static fraction, the trainer GPU's resident bytes.
Rank 0 writes it to `<run_dir>/memory_report.json` and one line of metrics.jsonl.

SGLang's own figures (the free memory it measured before loading, the KV tokens it allocated) are
in the target process's log; `engine_figures` reads them from it and `compare` holds all of it
against the plan (benchmarks/gpu_cli.py, the GPU check's real-CLI step):
- reserved - allocated beyond `max_cached_bytes`: blocks the trainer's allocator caches count as
  used in SGLang's measurement (train/learner.py `release_cached_memory`), a smaller KV pool than
  planned or an engine that does not start;
- SGLang's measured free memory below the plan's `free_before_load` (less a tolerance): the plan
  undercounts what is on the device when the target loads;
- SGLang's KV pool smaller than the plan's (a batch may not fit it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..plan import facts_from_folder, plan_memory

GB = 1 << 30  # SGLang's "GB" in its log is GiB (sglang srt/utils/common.py get_available_gpu_memory: / (1 << 30))
REPORT = "memory_report.json"


def trainer_figures(device: torch.device) -> dict:
    """What this process's allocator holds and keeps, and the device's free memory now (None off CUDA)."""
    if device.type != "cuda":
        return {"device": str(device), "allocated": None, "reserved": None, "free": None, "total": None}
    free, total = torch.cuda.mem_get_info(device)
    return {"device": str(device), "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "free": free, "total": total}


def plan_figures(job, model_path: str) -> dict:
    """The plan's figures for this run (plan/budget.py plan_memory); a run the plan cannot describe
    (a test's target smaller than the draft's default vocabulary) is reported with the plan's reason,
    never stopped by it: this is a report."""
    try:
        plan = plan_memory(job, facts_from_folder(model_path))
    except ValueError as err:  # PlanError is a ValueError
        return {"error": str(err)}
    trainer = [g for g in plan.gpus if "trainer" in g.role]
    return {"free_before_load": plan.free_before_load, "kv_pool_tokens": plan.kv_pool_tokens,
            "mem_fraction_static": plan.mem_fraction_static,
            "trainer_resident": trainer[0].resident() if trainer else None,
            "trainer_peak": trainer[0].total() if trainer else None}


_LOAD = re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB")
# "KV Cache is allocated. dtype: ..., #tokens: N" (sglang srt/mem_cache/memory_pool.py) and, after a
# CUDA graph capture resized the pool, "KV cache allocated. dtype: ..., #tokens: N"
# (srt/model_executor/model_runner_components/kv_pool_runtime.py): the last one is the pool's size
_KV = re.compile(r"(?:KV Cache is|KV cache) allocated\. dtype: [^,]+, #tokens: (\d+)")


def engine_figures(log: str) -> dict:
    """SGLang's measured free memory before loading (its first `Load weight begin. avail mem=` line,
    sglang srt/model_executor/model_runner.py) and the KV tokens it allocated last; None where not
    logged (the project's engines log at warning: benchmarks/gpu_cli.py raises these loggers to info)."""
    load, kv = _LOAD.search(log), _KV.findall(log)
    return {"free_before_load": int(float(load.group(1)) * GB) if load else None,
            "kv_pool_tokens": int(kv[-1]) if kv else None}


def compare(trainer: dict, plan: dict, engine: dict, max_cached_bytes: int, free_tolerance: float = 0.02) -> list[str]:
    """The problems (empty: within bounds). A figure that is None (not on CUDA, not logged) is not
    compared; the caller says whether it must be there."""
    out = []
    if trainer.get("reserved") is not None and trainer.get("allocated") is not None:
        gap = trainer["reserved"] - trainer["allocated"]
        if gap > max_cached_bytes:
            out.append(f"the trainer's allocator caches {gap / GB:.2f} GiB beyond what it holds (reserved "
                       f"{trainer['reserved'] / GB:.2f} - allocated {trainer['allocated'] / GB:.2f}), bound "
                       f"{max_cached_bytes / GB:.2f} GiB")
    measured, planned = engine.get("free_before_load"), plan.get("free_before_load")
    if measured is not None and planned is not None and measured < planned * (1 - free_tolerance):
        out.append(f"SGLang measured {measured / GB:.2f} GiB free before loading, the plan counted "
                   f"{planned / GB:.2f} GiB (tolerance {free_tolerance:.0%})")
    got, want = engine.get("kv_pool_tokens"), plan.get("kv_pool_tokens")
    if got is not None and want is not None and got < want:
        out.append(f"SGLang's KV pool holds {got} tokens, the plan {want}")
    return out


def at_stream_start(trainer) -> dict | None:
    """The report of a running Trainer (train/trainer.py), written once by rank 0."""
    if not trainer.ranks.main:
        return None
    report = {"trainer": trainer_figures(trainer.device), "plan": plan_figures(trainer.job, trainer.setup.model_path),
              "ranks": trainer.ranks.world, "sharded": bool(trainer.learner.sharded)}
    Path(trainer.run_dir, REPORT).write_text(json.dumps(report, indent=1))
    t, p = report["trainer"], report["plan"]
    trainer.logger.log({f"memory/trainer_{k}": t[k] for k in ("allocated", "reserved", "free") if t[k] is not None}
                       | {f"memory/plan_{k}": v for k, v in p.items() if isinstance(v, (int, float))},
                       trainer.progress.step)
    return report
