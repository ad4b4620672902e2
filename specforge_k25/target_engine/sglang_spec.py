"""Greedy generation in a real SGLang engine, with or without speculative decoding by an exported
draft (the engine arguments of one of its method's servings, `DraftMethod.servings`, passed in as a dict).

Each engine runs in its own worker process, `python -m specforge_k25.target_engine.sglang_spec`, for
three reasons: its memory is returned when it ends, a hung engine (SGLang can hang when its
scheduler crashes) is killed by a timeout, and the workarounds reach SGLang's scheduler: this
module applies `sglang_cpu_compat` at import (SPECFORGE_SGLANG_CPU=1, or SPECFORGE_SGLANG_GPU=1 on
CUDA). On CPU the engine's processes are forks of this worker (workaround 8), which has imported
sglang and nothing else; on CUDA SGLang spawns them, which re-imports this main module first.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specforge_k25.target_engine.base import CPU_MEM_FRACTION_STATIC

if os.environ.get("SPECFORGE_SGLANG_CPU") == "1":
    from specforge_k25.target_engine import sglang_cpu_compat

    sglang_cpu_compat.apply()
elif os.environ.get("SPECFORGE_SGLANG_GPU") == "1":  # CUDA: the sgl_kernel stand-in if its wheel is absent
    from specforge_k25.target_engine import sglang_cpu_compat

    sglang_cpu_compat.apply_gpu()

if __name__ in ("__main__", "__mp_main__"):  # the worker and every process SGLang starts from it
    # tqdm guards its bars with a multiprocessing RLock by default: a named POSIX semaphore that the
    # first bar of a process creates. SGLang's scheduler shows bars while loading weights, and
    # Engine.shutdown SIGKILLs the scheduler together with the resource tracker that would unlink
    # it, so one semaphore stayed in /dev/shm per engine run. Bars within one process need only a
    # thread lock.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


@dataclass
class Generation:
    outputs: list[list[int]]  # greedy completion per prompt
    completion_tokens: list[int]
    verify_steps: list[int] | None  # None without speculation
    start_s: float  # engine start
    generate_s: float


def engine_kwargs(spec) -> dict:
    """`generate`'s engine keywords from a target_engine/factory.py TargetSpec: the engine settings
    the training stream's target runs with (setup/target.py target_spec builds both)."""
    if spec.nnodes > 1:
        raise ValueError(f"an sglang.Engine here runs on one node (the target spans {spec.nnodes})")
    return dict(device=spec.device, dtype=spec.dtype, tp_size=spec.tp_size, gpu_id=spec.gpu_id,
                mem_fraction_static=spec.mem_fraction_static, max_total_tokens=spec.max_total_tokens,
                attention_backend=spec.attention_backend, num_threads=spec.num_threads,
                trust_remote_code=spec.trust_remote_code, load_threads=spec.load_threads,
                dist_timeout=spec.dist_timeout)


def generate(model_path: str, prompts: list[list[int]], *, max_new_tokens: int, device: str = "cpu",
             dtype: str = "float32", draft_path: str | None = None, draft_args: dict | None = None,
             max_running_requests: int = 8, mem_fraction_static: float = CPU_MEM_FRACTION_STATIC, max_total_tokens: int = 16384,
             num_threads: int = 1, gpu_id: int = 0, tp_size: int = 1, trust_remote_code: bool = False,
             attention_backend: str | None = None, draft_attention_backend: str | None = None,
             load_threads: int | None = None, dist_timeout: int | None = None,
             timeout_s: float = 1800, cuda_graph: bool | None = None) -> Generation:
    """Runs one engine over `prompts` (token ids) at temperature 0 in a worker process.
    Speculative with `draft_path` (an export folder) and `draft_args` (the sglang.Engine arguments
    of one of its draft method's servings, `Serving.sglang_args`), greedy without. `cuda_graph`: None = SGLang's default
    on GPU (on), off on CPU."""
    if (draft_path is None) != (draft_args is None):
        raise ValueError("speculation needs both a draft folder and the draft method's engine arguments")
    speculative = draft_args is not None
    what = (", ".join(f"{k.removeprefix('speculative_')}={v}" for k, v in draft_args.items())
            if speculative else "no speculation")
    if device == "cpu" and speculative and draft_args.get("speculative_eagle_topk", 1) != 1:
        raise ValueError(f"{what}: on CPU only chain drafts (topk=1) run (sglang_cpu_compat)")
    engine_args = dict(model_path=str(model_path), device=device, dtype=dtype, tp_size=tp_size, base_gpu_id=gpu_id,
                       mem_fraction_static=mem_fraction_static, max_total_tokens=max_total_tokens,
                       max_running_requests=max_running_requests, skip_server_warmup=True, log_level="error",
                       random_seed=0, trust_remote_code=trust_remote_code)
    if load_threads:  # as the training stream's engine loads (target_engine/sglang_engine.py)
        engine_args["model_loader_extra_config"] = json.dumps({"enable_multithread_load": True,
                                                               "num_threads": load_threads})
    if dist_timeout is not None:
        engine_args["dist_timeout"] = dist_timeout
    if device == "cpu":
        engine_args.update(attention_backend="torch_native", disable_cuda_graph=True, disable_overlap_schedule=True)
    else:
        if attention_backend:  # hw.target_attention_backend; None: SGLang's choice per GPU
            engine_args["attention_backend"] = attention_backend
        if cuda_graph is not None:
            engine_args["disable_cuda_graph"] = not cuda_graph
    if speculative:
        engine_args.update(draft_args, speculative_draft_model_path=str(draft_path))
        if draft_attention_backend:
            engine_args["speculative_draft_attention_backend"] = draft_attention_backend
    env = dict(os.environ)
    if device == "cpu":
        env.update(SPECFORGE_SGLANG_CPU="1", OMP_NUM_THREADS=str(num_threads))
    elif device == "cuda":
        env["SPECFORGE_SGLANG_GPU"] = "1"
    with tempfile.TemporaryDirectory(prefix="specforge-eval-") as tmp:
        request, result, ids = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "instance_ids")
        request.write_text(json.dumps({"engine": engine_args, "prompts": prompts, "max_new_tokens": max_new_tokens,
                                       "speculative": speculative}))
        try:
            proc = subprocess.run([sys.executable, "-m", "specforge_k25.target_engine.sglang_spec", str(request),
                                   str(result), str(ids)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"SGLang engine ({what}) did not finish in {timeout_s:.0f} s") from None
        finally:
            _remove_load_snapshots(ids)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(f"SGLang engine ({what}) failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        return Generation(**json.loads(result.read_text()))


def _run_engine(engine_args: dict, prompts: list[list[int]], max_new_tokens: int, speculative: bool,
                instance_ids: Path) -> Generation:
    import sglang

    _record_instance_ids(instance_ids)
    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_args)
    start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": max_new_tokens,
                                                                       "temperature": 0.0})
        generate_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    meta = [r["meta_info"] for r in results]
    verify = [int(m.get("spec_verify_ct") or 0) for m in meta] if speculative else None
    return Generation([list(r["output_ids"]) for r in results], [int(m["completion_tokens"]) for m in meta],
                      verify, start_s, generate_s)


def _record_instance_ids(path: Path) -> None:
    """Append to `path` the instance id of each engine this process starts, as SGLang draws it
    (`PortArgs.init_new`), before the engine starts: a scheduler that fails at start (say, no
    memory for the KV pool) makes SGLang SIGKILL this whole process, so the parent cleans up."""
    from sglang.srt.server_args import PortArgs

    init_new = PortArgs.init_new

    def recording(*args, **kwargs):
        port_args = init_new(*args, **kwargs)
        with open(path, "a") as f:
            f.write(port_args.instance_id + "\n")
        return port_args

    PortArgs.init_new = staticmethod(recording)


def _remove_load_snapshots(instance_ids: Path) -> None:
    """Remove the load-snapshot files of the engines listed in `instance_ids` from /dev/shm
    (`sglang_loads_<name>_<hash>.shm`, SGLang's managers/load_snapshot.py): `shutdown` SIGKILLs the
    scheduler, which never removes its file, and one that fails at start leaves it too. The names
    derive from these engines' own instance ids, so no other engine's file is touched."""
    if instance_ids.is_file():
        for instance_id in instance_ids.read_text().split():
            Path(load_snapshot_path(instance_id)).unlink(missing_ok=True)


def load_snapshot_path(instance_id: str) -> str:
    """SGLang 0.5.23's load_snapshot.shm_path_for(instance_id), without importing sglang into the
    calling process (tests/target_engine/test_sglang_spec.py holds the two equal)."""
    name = os.path.basename(instance_id.rstrip("/")) or "default"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    digest = hashlib.blake2s(instance_id.encode(), digest_size=4).hexdigest()
    return f"/dev/shm/sglang_loads_{safe}_{digest}.shm"

if __name__ == "__main__":
    req = json.loads(Path(sys.argv[1]).read_text())
    out = _run_engine(req["engine"], req["prompts"], req["max_new_tokens"], req["speculative"], Path(sys.argv[3]))
    Path(sys.argv[2]).write_text(json.dumps(asdict(out)))
