"""Smoke tests of the benchmark scripts' small modes: structure of their results, never timings."""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def bench(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ------------------------------------------------------------------------------ gpu_kimi_shapes
@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--activation-checkpointing", "--optimizer-device", "cpu"]])
def test_gpu_kimi_shapes_small_cpu(flags, tmp_path, capsys, one_torch_thread):
    g = bench("gpu_kimi_shapes")
    out = tmp_path / "gpu_kimi_shapes.json"
    g.main(["--device", "cpu", "--small", "--threads", "1", "--warmup", "1", "--iters", "1", "--out", str(out)] + flags)
    printed = capsys.readouterr().out
    tail = printed[printed.index("matmul rate ("):]  # the report comes last: rates, draft, then the table
    assert "one draft training step" in tail and tail.rstrip().endswith("┘")
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["seq_len"] for r in result["shapes"]] == [32, 64]
    for key in ("bf16_tflops", "fp32_tflops"):
        assert finite(result["matmul"][key]) and result["matmul"][key] > 0
    for row in result["shapes"]:
        assert row["status"] == "ok"
        for key in ("step_s", "teacher_s", "fwd_bwd_s", "optim_s", "tflops", "frac_of_bf16_matmul", "loss_last",
                    "grad_norm_last"):
            assert finite(row[key]), key
        assert row["flops"]["total"] > 0 and row["planned_bytes"] > 0
        assert (row["flops"]["draft_recompute"] > 0) is bool(flags)
    assert result["frozen_dtype"] == "bfloat16" and result["optimizer_device"] is None  # cpu is the trainer's device


def test_kimi_shapes_come_from_the_repo_config():
    g = bench("gpu_kimi_shapes")
    cfg = g.draft_config(small=False)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (7168, 56, 8, 128)
    assert (cfg.draft_vocab_size, cfg.vocab_size, cfg.intermediate_size) == (32000, 163840, 18432)


def cpu_sdpa_flop_formulas() -> dict:
    """torch's flop counter has no formula for the CPU flash-attention kernel the draft's causal SDPA
    runs on here (it would count 0 for it): count it with torch's own flash/efficient-attention
    formulas (forward 2 matmuls; backward 5: QK^T recomputed, then dP, dV, dQ, dK), as on a GPU."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


@pytest.mark.parametrize("bf16,checkpoint", [(False, False), (True, False), (True, True)])
def test_analytic_flops_match_torch_flop_counter(bf16, checkpoint, one_torch_thread):
    """The analytic count equals torch's count of the step (matmuls and the fused SDPA), with
    activation checkpointing's extra forward of every TTT step too."""
    from torch.utils.flop_counter import FlopCounterMode

    g = bench("gpu_kimi_shapes")
    argv = ["--device", "cpu", "--small"] + ([] if bf16 else ["--no-bf16"])
    args = g.parse_args(argv + (["--activation-checkpointing"] if checkpoint else []))
    cfg = g.draft_config(small=True)
    cpu = torch.device("cpu")
    for T in (16, 40):
        trainer = g.build_learner(cfg, cpu, args)
        assert trainer.activation_checkpointing is checkpoint
        assert trainer.lm_head.dtype == trainer.draft.embed_tokens.weight.dtype == g.frozen_dtype(bf16)
        inputs = g.random_inputs(cfg, 1, T, cpu)
        with FlopCounterMode(display=False, custom_mapping=cpu_sdpa_flop_formulas()) as counter:
            g.timed_step(trainer, inputs, cpu)
        flops = g.step_flops(cfg, 1, T, args.ttt_length, checkpoint=checkpoint)
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        sdpa = {op: n for op, n in counts.items() if "scaled_dot_product" in op}
        assert sum(sdpa.values()) == flops["attention_fwd"] * (2 if checkpoint else 1) + flops["attention_bwd"], sdpa
        assert counter.get_total_flops() == flops["total"]
        assert (flops["draft_recompute"] > 0) is checkpoint


def test_step_flops_attention_and_checkpointing():
    """Hand-checked numbers for a toy config: step 0's causal SDPA sees T keys at hd = 2, step 1's
    augmented SDPA (draft/eagle3/ttt_attention.py) T+1 rows at W = 8 (2 + 2 sink columns under bf16,
    rounded up to 8); torch counts both at nh heads, every block."""
    from specforge_k25.draft.eagle3.model import DraftConfig

    g = bench("gpu_kimi_shapes")
    cfg = DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                      vocab_size=32, draft_vocab_size=16, target_hidden_size=8)
    B, T, K = 2, 3, 2
    f = g.step_flops(cfg, B, T, K)
    # QK^T and PV: 2 matmuls of 2*B*nh*T*T*hd at step 0, of 2*B*nh*(T+1)*(T+1)*W at step 1
    assert f["attention_fwd"] == 2 * (2 * B * 4 * T * T * 2) + 2 * (2 * B * 4 * (T + 1) * (T + 1) * 8) == 4672
    assert f["attention_bwd"] == 5 * f["attention_fwd"] // 2
    linear = 2 * B * T * (2 * 8 * (4 + 2 * 2) * 2 + 4 * 2 * 8 + 3 * 8 * 16 + 8 * 16)
    fc = 2 * B * T * 3 * 8 * 8
    assert f["draft_fwd"] == fc + K * linear + f["attention_fwd"]
    assert f["draft_bwd"] == fc + 2 * K * linear + f["attention_bwd"]
    assert f["teacher"] == 2 * B * T * 32 * 8 and f["draft_recompute"] == 0
    c = g.step_flops(cfg, B, T, K, checkpoint=True)
    assert c["draft_recompute"] == K * linear + f["attention_fwd"]
    assert c["total"] == f["total"] + c["draft_recompute"]


def test_planned_bytes_follow_the_settings():
    """The plan the table prints beside the peak uses the run's settings: bf16 frozen tensors,
    checkpointing and AdamW offload each lower it; --optimizer-device naming the trainer's own
    device is no offload."""
    g = bench("gpu_kimi_shapes")
    cfg = g.draft_config(small=False)

    def plan(bf16=True, checkpoint=False, offloaded=False):
        return g.planned_bytes(cfg, 1, 2048, 7, 1024, bf16, checkpoint=checkpoint, optimizer_offloaded=offloaded)

    base = plan()
    V, H = cfg.vocab_size, cfg.hidden_size
    # fp32 frozen lm_head: 2 more bytes per element (the embedding is on the host); the fp32 teacher
    # chunk has no bf16 copy
    assert plan(bf16=False) > base + 2 * V * H - 1024 * V * 2
    assert plan(checkpoint=True) < base
    assert plan(offloaded=True) < base
    args = g.parse_args(["--optimizer-device", "cpu"])
    assert g.optimizer_device(args, torch.device("cpu")) is None
    assert g.optimizer_device(args, torch.device("cuda:0")) == "cpu"
    assert g.optimizer_device(g.parse_args([]), torch.device("cuda:0")) is None
    assert g.optimizer_device(g.parse_args(["--optimizer-device", "cuda:1"]), torch.device("cuda:0")) == "cuda:1"


def test_oom_is_reported_not_raised(tmp_path, monkeypatch, capsys, one_torch_thread):
    g = bench("gpu_kimi_shapes")

    def run_shape(cfg, seq_len, device, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 GiB")

    monkeypatch.setattr(g, "run_shape", run_shape)
    out = tmp_path / "g.json"
    result = g.main(["--device", "cpu", "--small", "--seq-lens", "32", "--threads", "1", "--out", str(out)])
    assert result["shapes"][0]["status"] == "OOM"
    assert "OOM" in capsys.readouterr().out
    with pytest.raises(ValueError):  # anything else still fails loudly
        monkeypatch.setattr(g, "run_shape", lambda *a: (_ for _ in ()).throw(ValueError("bug")))
        g.measure_shape(None, 32, torch.device("cpu"), None)


# ------------------------------------------------------------------------------- teacher_memory
@pytest.mark.slow
def test_teacher_memory_child_process():
    """One memory config in its own process (the full run does 8 of these)."""
    t = bench("teacher_memory")
    spec = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=192, draft_vocab=256, seq_len=256,
                threads=1, vocab=2048, chunk=32)
    row = t.run_memory_config(spec)
    for key in ("resident_before_step", "teacher_peak_delta", "ttt_peak_delta", "step_peak_delta"):
        assert isinstance(row[key], int), key
    assert row["step_peak_delta"] > 0 and row["resident_before_step"] > 0


def test_teacher_memory_small_time_part(tmp_path, capsys, one_torch_thread):
    t = bench("teacher_memory")
    out = tmp_path / "teacher_memory.json"
    result = t.main(["--small", "--skip-memory", "--reps", "1", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "teacher_memory"
    assert out.with_suffix(".png").stat().st_size > 0
    assert "draft step time vs T" in capsys.readouterr().out
    for key in ("vs_seq_len", "vs_ttt_length"):
        assert result["time"][key]
        for row in result["time"][key]:
            assert all(finite(row[k]) for k in ("step_s", "teacher_s", "fwd_bwd_s", "optim_s", "tokens_per_s"))


# ---------------------------------------------------------------------------- online_vs_offline
def test_offline_dump_roundtrip(tmp_path):
    """The offline pass writes exactly what the stream carried and reads it back unchanged."""
    o = bench("online_vs_offline")
    from specforge_k25.data.tokenize import Sample

    samples = [Sample(torch.arange(5), torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool)),
               Sample(torch.arange(3) + 7, torch.tensor([0, 1, 1], dtype=torch.bool))]
    aux, final = torch.randn(8, 12), torch.randn(8, 4)
    path = tmp_path / "batch_000000.safetensors"
    o.dump_batch(path, samples, [5, 3], aux, final)
    got_samples, lengths, got_aux, got_final = o.load_batch(path)
    assert lengths == [5, 3]
    assert torch.equal(got_aux, aux) and torch.equal(got_final, final)
    for a, b in zip(got_samples, samples):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert o.allocated_bytes(tmp_path) >= aux.numel() * 4


def test_kimi_bytes_per_token():
    o = bench("online_vs_offline")
    k = o.kimi_extrapolation(tokens=1000, dump_bytes=1000 * 9216, hidden=576, elem_bytes=4)
    assert k["kimi_bytes_per_token"] == 4 * 7168 * 2 == 57344
    assert k["this_target_bytes_per_token_analytic"] == 9216
    assert k["kimi_bytes_per_1b_tokens"] == 57344 * 10**9


# ------------------------------------------------------------------------------------ stream
def test_stream_plot_from_result(tmp_path):
    s = bench("stream")
    phases = {name: {"tokens_per_s": rate} for name, rate in
              (("target_only", 180.0), ("trainer_only", 110.0), ("online", 105.0))}
    result = {"phases": phases, "bottleneck": "trainer_only", "goal": 0.95, "ratio_online_over_min": 105 / 110}
    out = tmp_path / "stream.json"
    out.write_text(json.dumps(result))
    s.main(["--replot", "--out", str(out)])
    assert out.with_suffix(".png").stat().st_size > 0


# ------------------------------------------------------------------------------------ gpu_e2e
ROOT = BENCHMARKS.parent
GPU_IMAGE_SITE = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_image_site"


def image_only_env() -> dict:
    """A process (and its children) that sees only the H200 image's packages, the wheels carried to it
    and this project (tests/fixtures/gpu_image_site): an import the wheel list misses fails here."""
    path = [str(GPU_IMAGE_SITE), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "SPECFORGE_GPU_IMAGE_ONLY": "1", "PYTHONPATH": os.pathsep.join(path),
            "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow
def test_gpu_e2e_slot_check_catches_a_copy_tied_to_the_slot(tmp_path, one_torch_thread):
    """c) can fail: a trainer whose DraftBatch still reads the slot after release (what an unfinished
    CUDA copy does) is caught, because the producer refills the slot while the consumer sleeps."""
    g = bench("gpu_e2e")
    from specforge_k25.train.learner import DraftLearner

    args = g.parse_args(["--device", "cpu", "--small"])
    size = dict(g.SIZES["small"], samples=8)
    path = g.build_random_target(tmp_path / "target", small=True, seed=0)
    job = g.make_job(args, path, size, "float32")
    setup = g.make_setup(job, path, g.random_samples(size["samples"], size["lengths"], g.SMALL["vocab_size"], 0))
    copy_batch = DraftLearner.make_batch

    def tied_to_the_slot(self, samples, lengths, aux_packed, final_packed):
        batch = copy_batch(self, samples, lengths, aux_packed, final_packed)
        batch.aux_hidden = aux_packed[None]  # a view into the slot instead of the copy
        return batch

    DraftLearner.make_batch = tied_to_the_slot
    try:
        res, _, _ = g.check_slots(job, setup, torch.device("cpu"), 4, 0.3, hf_batches=0)
    finally:
        DraftLearner.make_batch = copy_batch
    assert not res["ok"] and len(res["mismatched_items"]) >= 2, res  # the last 2 slots are never refilled


def test_gpu_e2e_reports_a_check_that_raises(tmp_path, monkeypatch, capsys, one_torch_thread):
    """One lent GPU run must say as much as it can: a check that raises is a FAIL line, the end of its
    traceback is printed (all of it in the JSON) with the check's wall time, and the run goes on; the JSON
    is written."""
    g = bench("gpu_e2e")

    def broken(*args, **kwargs):
        raise RuntimeError("engine did not start")

    monkeypatch.setattr(g, "check_stream", broken)
    out = tmp_path / "r.json"
    result = g.main(["--device", "cpu", "--small", "--checks", "b", "--out", str(out)])
    assert result["lines"] == ["FAIL b raised RuntimeError: engine did not start"] and not result["ok"]
    assert "engine did not start" in json.loads(out.read_text())["errors"]["b"]
    printed = capsys.readouterr().out  # what the device log shows: where it failed and how long it took
    assert "Traceback (most recent call last)" in printed and 'raise RuntimeError("engine did not start")' in printed
    assert "TIME b: " in printed and set(result["check_wall_s"]) == {"b"}


_CUDA_IMPORTS = """
    import torch
    torch.cuda.is_available = lambda: True  # sglang's is_cuda(): the CUDA import paths, on this CPU
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.device_count = lambda: 1
    from specforge_k25.target_engine import sglang_cpu_compat
    assert sglang_cpu_compat.apply_gpu()
    for name in ("sglang.srt.entrypoints.engine", "sglang.benchmark.one_batch", "sglang.srt.managers.scheduler",
                 "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
                 "sglang.srt.function_call.function_call_parser", "sglang.srt.model_executor.model_runner",
                 "sglang.srt.models.llama", "sglang.srt.models.llama_eagle3", "sglang.srt.speculative.eagle_worker_v2",
                 "sglang.srt.layers.attention.triton_backend", "sglang.kernels.ops.kvcache.kvcache"):
        __import__(name)
    print("IMPORTED")
"""


@pytest.mark.slow
def test_gpu_wheels_cover_sglang_cuda_imports():
    """SGLang's CUDA-side modules (CUDA faked, the GPU stand-in for sgl_kernel) import with the image's
    packages and the carried wheels only."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_CUDA_IMPORTS)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={k: v for k, v in image_only_env().items()
                                                      if not k.startswith("SGLANG_")})
    assert proc.returncode == 0 and "IMPORTED" in proc.stdout, proc.stderr[-3000:]


def test_gpu_wheel_list_is_pinned_and_small():
    pins = [ln.split("#")[0].split() for ln in (BENCHMARKS / "gpu_wheels.txt").read_text().splitlines()]
    pins = [p[0] for p in pins if p]
    assert all("==" in p for p in pins) and len({p.split("==")[0] for p in pins}) == len(pins)
    assert "sglang==0.5.23" in pins
    sizes = [float(ln.split("#")[1].split()[0]) for ln in (BENCHMARKS / "gpu_wheels.txt").read_text().splitlines()
             if "==" in ln.split("#")[0]]
    assert len(sizes) == len(pins) and sum(sizes) < 56, sum(sizes)  # 64 MiB per device run, the tree included


# ------------------------------------------------------------------------------ colocated
# The layouts themselves run end to end in tests/train/test_colocated.py (which also checks the
# summary fields read here); these tests run the benchmark's own parts: the sampler on a process
# tree shaped like a co-located launch, and the result it assembles from two runs.
FAKE_TREE = textwrap.dedent("""
    import json, subprocess, sys, time
    from pathlib import Path
    def busy(s):
        end = time.process_time() + s
        while time.process_time() < end:
            pass
    level, out = sys.argv[1], Path(sys.argv[2])
    if level == "torch.distributed.run":
        kids = [subprocess.Popen([sys.executable, __file__, "specforge_k25.train", str(out)]) for _ in range(2)]
        busy(0.2)
        [k.wait() for k in kids]
        out.joinpath("summary.json").write_text(json.dumps(
            {"train_wall_s": 1.5, "tokens_trained": 640, "tokens_per_s": 426.7, "stream_wait_frac": 0.25}))
    elif level == "specforge_k25.train":
        kid = subprocess.Popen([sys.executable, __file__, "spawn_main", str(out)])
        busy(0.6)
        kid.wait()
    else:
        busy(0.6)
""")


@pytest.mark.slow
def test_colocated_benchmark_samples_every_process_by_role(tmp_path):
    """run() on a launcher -> 2 trainer ranks -> a target each: every process named by its role,
    busy shares that add up to the CPU the tree spent, the summary's numbers passed on."""
    b = bench("colocated")
    script = tmp_path / "tree.py"
    script.write_text(FAKE_TREE)
    result = b.run("colocated", [sys.executable, str(script), "torch.distributed.run", str(tmp_path)], tmp_path,
                   poll_s=0.05)
    shares = result["busy_share"]
    assert sorted(shares) == ["launcher 0", "target 0", "target 1", "trainer 0", "trainer 1"]
    assert all(0.0 < v <= 1.0 for v in shares.values()), shares
    assert shares["trainer 0"] > shares["launcher 0"] and shares["target 1"] > shares["launcher 0"]
    assert result["tokens_trained"] == 640 and result["stream_wait_frac"] == 0.25
    assert result["cpu_s_total"] >= 0.2 + 4 * 0.6


def test_colocated_benchmark_result_from_two_runs(tmp_path, monkeypatch, capsys):
    """main(): the dedicated then the co-located command, the ratio of their tokens/s, the JSON."""
    b = bench("colocated")
    commands = []

    def fake_run(name, cmd, run_dir, poll_s=0.5):
        commands.append(cmd)
        return {"layout": name, "command": " ".join(cmd[1:]), "wall_s": 2.0, "train_wall_s": 1.0,
                "tokens_trained": 600, "tokens_per_s": {"dedicated": 300.0, "colocated": 240.0}[name],
                "stream_wait_frac": 0.1, "busy_share": {"trainer 0": 0.5}, "cpu_s_total": 3.0}

    monkeypatch.setattr(b, "run", fake_run)
    out = tmp_path / "colocated.json"
    result = b.main(["--smoke", "--out", str(out)])
    dedicated, colocated = commands
    assert "torch.distributed.run" not in dedicated and "train.batch_size=4" in dedicated
    assert "--nproc-per-node=2" in colocated and "hw.trainer_layout=colocated" in colocated
    assert "train.batch_size=2" in colocated and "hw.target_tp=2" in dedicated and "hw.target_tp=2" in colocated
    assert result["colocated_over_dedicated_tokens_per_s"] == 0.8
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert "co-located / dedicated tokens/s: 0.800" in capsys.readouterr().out


# ------------------------------------------------------------------------------ padding
def test_padding_small(tmp_path, capsys):
    out = tmp_path / "padding.json"
    result = bench("padding").main(["--small", "--lengths", "256", "--batches", "1,4", "--out", str(out)])
    assert "grouped by length" in capsys.readouterr().out and out.with_suffix(".png").stat().st_size > 0
    (point,) = json.loads(out.read_text())["points"]
    assert point == result["points"][0] and point["max_length"] == 256 and point["samples"] > 0
    one, four = point["rows"]
    assert one["shuffled"] == one["grouped"] == 0.0  # batch 1 pads nothing
    assert 0.0 <= four["grouped"] <= four["shuffled"] < 1.0


# ------------------------------------------------------------------------------ host_adamw
def test_host_adamw_small(tmp_path):
    h = bench("host_adamw")
    out = tmp_path / "host_adamw.json"
    result = h.main(["--params", "100000", "--tensor-mib", "0.1", "--threads", "1", "--steps", "1", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert result["params"] == 100000 and result["tensors"] == 4  # 26,214 per 0.1 MiB tensor, the rest in a fourth
    assert [(r["mode"], r["threads"]) for r in result["rows"]] == [("loop", 1), ("foreach", 1), ("fused", 1)]
    assert all(finite(r["ns_per_param"]) and r["ns_per_param"] > 0 for r in result["rows"])
    with pytest.raises(SystemExit, match="unknown"):
        h.main(["--modes", "fast", "--out", str(out)])
