"""Workaround 8, target_engine/sglang_cpu_compat/fork_subprocesses.py: an engine's scheduler and
detokenizer forked on CPU, not spawned."""
from __future__ import annotations

import json
import re

import pytest
from compat_subprocess import run, sglang_source  # this folder is on sys.path (pytest's default prepend import mode)

from specforge_k25.target_engine.base import CPU_MEM_FRACTION_STATIC

PROMPT, NEW_TOKENS = [1, 2, 3, 4, 5, 6], 6

_ENGINE = """
    import json
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply()
    import sglang

    import multiprocessing.process
    started, start = [], multiprocessing.process.BaseProcess.start

    def recording_start(self):  # how each process SGLang starts was made: popen_fork or popen_spawn_posix
        start(self)
        started.append(type(self._popen).__module__.rsplit(".", 1)[-1])

    multiprocessing.process.BaseProcess.start = recording_start

    engine = sglang.Engine(model_path={path!r}, device="cpu", dtype="float32", attention_backend="torch_native",
                           disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static={fraction},
                           max_total_tokens=2048, max_running_requests=2, skip_server_warmup=True,
                           log_level="error", random_seed=0)
    try:
        out = engine.generate(input_ids=[{prompt}], sampling_params={{"max_new_tokens": {n}, "temperature": 0.0}})
    finally:
        engine.shutdown()
    print("RESULT", json.dumps({{"started": started, "ids": list(out[0]["output_ids"])}}))
"""


def test_sglang_still_spawns_engine_subprocesses():
    """Needed: SGLang's engine still forces `spawn` for its subprocesses (else drop workaround 8)."""
    source = sglang_source("srt/entrypoints/engine.py")
    body = source.split("def _set_envs_and_config(", 1)[1].split("\ndef ", 1)[0]
    assert 'mp.set_start_method("spawn", force=True)' in body, "SGLang no longer forces spawn: drop workaround 8"
    assert re.search(r"proc = mp\.Process\(", source), "SGLang starts its subprocesses another way: review workaround 8"


@pytest.mark.engine
@pytest.mark.slow
def test_engine_subprocesses_are_forked_and_serve_as_spawned(smollm2_path):
    """Works: with apply(), the two processes an engine starts (scheduler, detokenizer) are forks
    (multiprocessing's popen_fork), and its greedy tokens equal HF transformers'."""
    out = run(_ENGINE.format(path=smollm2_path, fraction=CPU_MEM_FRACTION_STATIC, prompt=PROMPT, n=NEW_TOKENS))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["started"] == ["popen_fork", "popen_fork"], result  # scheduler, detokenizer

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):]
    assert result["ids"] == ref.tolist()
