"""The GPU check's SGLang engine arguments, resolved by SGLang on a CPU that says it is an H200.

`engine_args(...)` captures the exact `sglang.Engine` keywords benchmarks/gpu_spec.py's engines get on
CUDA (target_engine/sglang_spec.generate builds them; its worker process is not started), and
`resolve_on_h200(configs)` constructs SGLang's `ServerArgs` from each in a child where torch reports an
H200 (capability 9.0, 140 GiB free) and sglang_cpu_compat.apply_gpu() is in place, as in the device's
engine processes: SGLang's argument resolution (speculative settings, the DFlash draft backend, CUDA
graph settings) runs as it will there, and a refusal comes back with its message instead of on the
lent machine.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _gpu_device import FAKE_H200

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("speculative_algorithm", "speculative_draft_attention_backend", "speculative_num_steps",
          "speculative_eagle_topk", "speculative_num_draft_tokens", "disable_cuda_graph", "mem_fraction_static",
          "dtype", "device")


class _Captured(Exception):
    pass


def engine_args(engines, model_path: str, prompts, graphs: bool, **draft) -> dict:
    """What `engines.run(...)` (gpu_spec.Engines) hands sglang.Engine, without starting it."""
    from specforge_k25.target_engine import sglang_spec

    seen = {}

    def capture(cmd, **kw):
        seen.update(json.loads(Path(cmd[-3]).read_text())["engine"])  # the request file the worker reads
        raise _Captured

    real = sglang_spec.subprocess.run
    sglang_spec.subprocess.run = capture
    try:
        engines.run(model_path, prompts, graphs, **draft)
    except _Captured:
        pass
    finally:
        sglang_spec.subprocess.run = real
    return seen


_RESOLVE = FAKE_H200 + """
torch.cuda.mem_get_info = lambda *a, **k: (140 << 30, 141 << 30)
from specforge_k25.target_engine import sglang_cpu_compat
sglang_cpu_compat.apply_gpu()
import json, sys
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.server_args import ServerArgs
fields = json.loads(sys.argv[2])
for cfg in json.loads(sys.argv[1]):
    try:
        view = resolved_view(ServerArgs(**cfg))
        print("RESOLVED " + json.dumps({k: getattr(view, k, None) for k in fields}, default=str), flush=True)
    except Exception as err:
        print("REFUSED " + json.dumps(f"{type(err).__name__}: {err}"[:1000]), flush=True)
"""


def resolve_on_h200(configs: list[dict], timeout_s: int = 300) -> list[dict]:
    """Per config: {"ok": True, resolved fields} or {"ok": False, "error": SGLang's message}."""
    out = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(configs), json.dumps(FIELDS)],
                         capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("RESOLVED "):
            rows.append({"ok": True, **json.loads(line[len("RESOLVED "):])})
        elif line.startswith("REFUSED "):
            rows.append({"ok": False, "error": json.loads(line[len("REFUSED "):])})
    if len(rows) != len(configs):
        raise RuntimeError(f"the resolver stopped after {len(rows)} of {len(configs)} (exit {out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return rows
