"""The production path on one GPU, end to end: SGLang target, CUDA slot ring, trainer, SGLang's EAGLE-3.

On the device machine (one H200, no network; .whl/ carried, see scripts/gpu_wheels.sh), in the repo root,
in two halves that each fit one 10-minute command (the exact lines: docs/PERFORMANCE.md section 7):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_e2e.py --device cuda --checks abc
    ... the same with --checks d

Results go to $OUT/gpu_e2e_<checks>.json where the device tool sets OUT (nothing else comes back
from the machine), else docs/gpu_h200/ (cuda) or benchmarks/results/gpu_e2e_cpu.json (cpu); --out
overrides. A check that raises prints the last 25 lines of its traceback; every check prints its
wall time. CPU mode (tests/benchmarks/test_benchmarks.py runs it):
python benchmarks/gpu_e2e.py --device cpu --small --out X.json

A SmolLM2-135M-shaped Llama with random weights is built in a temp folder (--small: 8 layers, hidden
64), with a word-level tokenizer; the samples are random token ids. One line per check:
  a) captured aux/final hidden states == HF transformers on the same device: fp32 within 1e-4 x
     max(1, |ref|); bf16 no further from HF fp32 than HF's own bf16 is (x2, at least one bf16 ulp);
  b) engine and trainer on one device through the ring (benchmarks/stream.py's phases): target-only,
     trainer-only and online tokens/s, online / min of the two; peak device memory during online vs
     the memory plan (CUDA only);
  c) slot checksums: 2 slots, many batches, a consumer that sleeps; the checksum of every trainer
     copy (DraftBatch after make_batch + final) equals the one the producer recorded for the slot;
  d) SGLang's own EAGLE-3 decoding (chain 3/1/4) with the head trained in b) (untrained when b does
     not run in the same command), exported: speculative output == greedy output, CUDA graphs off
     and on (on CPU: off only), each mode on its own so that one failing keeps the other's result.
On CUDA, before any engine: TRITON_F32_DEFAULT=ieee (SGLang's triton attention calls tl.dot with no
precision, which in fp32 means TF32: a's 1e-4 bound and d's spec == greedy would fail by arithmetic),
and SGLang's JIT kernels are built once (KV store; EAGLE tree kernels when d runs), their log printed
if a build fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from _common import GiB, MiB, RESULTS, machine_info, set_threads, write_json
from _gpu_device import MemorySampler, jit_preflight, memory_vs_plan
from stream import PhaseClock, phase_online, phase_trainer_only
from specforge_k25.config import JobConfig
from specforge_k25.data.dataset import TokenizedData
from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.registry import method_of_spec
from specforge_k25.export.serving import export_draft
from specforge_k25.plan import facts_from_folder, plan_memory, resolve_draft
from specforge_k25.setup.run import RunSetup, make_target_stream
from specforge_k25.stream.ring import slot_checksum
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import layer_id_rule, resolve_capture_points, sglang_layer_ids
from specforge_k25.target_engine.sglang_spec import generate
from specforge_k25.train.schedule import build_schedule
from specforge_k25.train.trainer import build_learner

ROOT = Path(__file__).resolve().parents[1]
GPU_OUT = ROOT / "docs" / "gpu_h200" / "gpu_e2e.json"
# SmolLM2-135M's config.json (the packaged model, converted by specforge_k25/target_engine/models.py)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SMALL = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=2048)
# sizes per mode: samples, tokens per sample (min, max), batch size, draft vocab, TTT steps, stress batches
SIZES = {"gpu": dict(samples=256, lengths=(256, 1024), batch=4, draft_vocab=32000, ttt=7, stress=160, sleep=0.01,
                     max_total_tokens=8192, new_tokens=48),
         "small": dict(samples=24, lengths=(24, 80), batch=2, draft_vocab=256, ttt=3, stress=16, sleep=0.05,
                       max_total_tokens=2048, new_tokens=16)}


def default_out(args) -> Path:
    """$OUT where the device tool sets it: only what is written there comes back from the machine."""
    name = "gpu_e2e.json" if sorted(args.checks) == list("abcd") else f"gpu_e2e_{args.checks}.json"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return GPU_OUT.parent / name if args.device == "cuda" else RESULTS / "gpu_e2e_cpu.json"


def prepare_cuda_env() -> None:
    """Before any engine: every engine process inherits these, and triton reads the first when it compiles.
    SGLang's triton attention calls tl.dot with no input precision, which in fp32 is TF32 on GPUs."""
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    os.environ["PYTHONUNBUFFERED"] = "1"  # the engines' output in order, also in a log cut short


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="a much smaller Llama and data (the CPU mode)")
    p.add_argument("--checks", default="abcd", help="which checks to run: 'abc' and 'd' are the two halves of a "
                                                    "device run (b trains the head d serves, if both run)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON result (default: $OUT/gpu_e2e_<checks>.json where "
                                                          "OUT is set, else docs/gpu_h200/ on cuda, "
                                                          "benchmarks/results/gpu_e2e_cpu.json on cpu)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ target, data, job
def build_random_target(folder: Path, small: bool, seed: int) -> str:
    """A random-weight Llama of SmolLM2-135M's shape (or SMALL) as an HF folder, with a word-level
    tokenizer ("t0".."tV-1") built offline: SGLang loads a tokenizer for every model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fields = SMALL if small else SMOLLM2
    config = LlamaConfig(**fields, initializer_range=0.05)  # wider than 0.02: peaked logits, few greedy near-ties
    torch.manual_seed(seed)
    # bf16 on disk: the plan reads the weight size from the files (the bf16 run is the one it is checked
    # against); fp32 engines and HF upcast the same values, so fp32 comparisons stay exact
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(fields["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t2").save_pretrained(folder)
    return str(folder)


def random_samples(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[Sample]:
    """Token ids in [3, vocab); the first quarter of each sample is prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        mask = torch.arange(t) >= t // 4
        out.append(Sample(torch.randint(3, vocab, (t,), generator=g), mask))
    return out


def make_job(args, model_path: str, size: dict, dtype: str) -> JobConfig:
    job = JobConfig()
    job.target.name, job.target.builtin, job.target.path = "smollm2_random", "none", model_path
    job.hw.device, job.hw.target_dtype = args.device, dtype
    job.hw.autocast = "bf16" if args.device == "cuda" and dtype == "bfloat16" else "none"
    job.hw.target_threads = job.hw.trainer_threads = args.threads
    job.hw.max_total_tokens = size["max_total_tokens"]
    job.data.max_length, job.data.num_samples, job.data.heldout_samples = size["lengths"][1], size["samples"], 0
    job.draft.vocab_size, job.draft.ttt_length = size["draft_vocab"], size["ttt"]
    tr = job.train
    tr.batch_size, tr.grad_accum, tr.logger, tr.progress = size["batch"], 1, "none", False
    tr.stream_timeout_s, tr.engine_start_timeout_s = 300.0, 600.0
    if args.device == "cuda":  # the plan derives SGLang's static fraction for this GPU and layout
        job.hw.name, job.hw.num_gpus = "h200", 1
        job.hw.gpu_memory_mib = torch.cuda.get_device_properties(0).total_memory // MiB
        derived = plan_memory(job, facts_from_folder(model_path)).mem_fraction_static
        # the plan counts bf16 weights and KV (the measured run); fp32 engines get a fixed, ample share
        job.hw.mem_fraction_static = derived if dtype == "bfloat16" else 0.05
    return job


def make_setup(job: JobConfig, model_path: str, samples: list[Sample]) -> RunSetup:
    """What `prepare` decides, for random token ids instead of a tokenized data set."""
    info = read_target_info(model_path)
    points = resolve_capture_points(job.target.aux_layers, info.num_layers)
    data = TokenizedData(train=samples, heldout=[], rows_seen=len(samples))
    return RunSetup(model_path, info, points, sglang_layer_ids(points, layer_id_rule(info.architecture)), None, data,
                    method_of_spec(job.draft), resolve_draft(job.draft, facts_from_folder(model_path), len(points)))


def schedule(job: JobConfig, n: int) -> tuple[list[list[int]], int]:
    items, steps = build_schedule(n, 0, batch_size=job.train.batch_size, grad_accum=1, epochs=1, max_steps=None,
                                  eval_every=None, seed=job.train.seed)
    return [i.sample_ids for i in items], steps


def sync(t: torch.Tensor) -> None:
    if t.is_cuda:  # CUDA copies are asynchronous: they must finish before the slot goes back
        torch.cuda.current_stream(t.device).synchronize()


# ---------------------------------------------------------------------------- a) HF comparison
def compare_with_hf(model_path: str, points: list[int], captured: list, samples: list, plan: list, dtype: str,
                    device: str) -> dict:
    """captured: [(lengths, aux, final)] of the first batches of `plan`. fp32: the 1e-4 bound of
    tests/target_engine/test_target.py. bf16: relative Frobenius error vs HF fp32, against HF bf16's own."""
    seqs = [samples[i].input_ids.to(device) for ids in plan[:len(captured)] for i in ids]
    got_aux = torch.cat([a.float() for _, a, _ in captured]).to(device)
    got_final = torch.cat([f.float() for _, _, f in captured]).to(device)
    refs = {}
    for name in ("float32", "bfloat16") if dtype == "bfloat16" else ("float32",):
        hf = HFTarget(model_path, points, getattr(torch, name))
        hf.model.to(device)
        out = hf.forward(seqs)
        refs[name] = (out.aux_hidden.float(), out.final_hidden.float())
        del hf, out
    res = {"dtype": dtype, "sequences": len(seqs), "tokens": int(got_aux.shape[0])}
    ok = True
    for k, (name, got) in enumerate((("aux", got_aux), ("final", got_final))):
        ref = refs["float32"][k]
        if dtype == "float32":
            worst = ((got - ref).abs() / (1e-4 * ref.abs().clamp(min=1.0))).max().item()
            res[name] = {"max_diff_over_bound": worst, "max_abs_diff": (got - ref).abs().max().item()}
            ok &= worst <= 1.0
        else:
            rel = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
            mine, hfs = rel(got), rel(refs["bfloat16"][k])
            res[name] = {"rel_err_vs_hf_fp32": mine, "hf_bf16_rel_err": hfs, "bound": 2 * max(hfs, 2 ** -8)}
            ok &= mine <= res[name]["bound"]
    res["ok"] = bool(ok)
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def describe_a(r: dict) -> str:
    if r["dtype"] == "float32":
        return (f"max |diff| / (1e-4 max(1,|ref|)): aux {r['aux']['max_diff_over_bound']:.3g}, final "
                f"{r['final']['max_diff_over_bound']:.3g} ({r['sequences']} sequences, {r['tokens']} tokens)")
    return "; ".join(f"{k} rel err {r[k]['rel_err_vs_hf_fp32']:.2e} vs HF bf16 {r[k]['hf_bf16_rel_err']:.2e} "
                     f"(bound {r[k]['bound']:.2e})" for k in ("aux", "final")) + f" ({r['tokens']} tokens)"


# ------------------------------------------------------------------------- b) stream throughput
def phase_target_only(job, setup, plan) -> tuple[dict, list, list]:
    """benchmarks/stream.py's phase A, with the copies finished before each slot goes back (its own
    version releases right after enqueuing the clones: safe on CPU, a race on CUDA)."""
    kept, sums = [], []
    stream = make_target_stream(job, setup, setup.data.train, plan)
    clock = PhaseClock("target_only")
    with stream:
        for msg, aux, final in stream:
            kept.append((list(msg.lengths), aux.clone(), final.clone()))
            sync(aux)
            stream.release(msg)
            sums.append(msg.checksum)
            clock.item_done(sum(msg.lengths))
    return clock.result(stream_wait_s=stream.wait_s), kept, sums


def check_stream(job, setup, device: torch.device, hf_batches: int) -> tuple[dict, dict, object]:
    plan, steps = schedule(job, len(setup.data.train))
    trainers = []

    def factory():  # as stream.TrainerFactory, on this device; the last one's head is exported for d)
        trainers.append(build_learner(job, setup, steps, device))
        return trainers[-1]

    target_only, kept, sums = phase_target_only(job, setup, plan)
    copies_ok = sum(abs(slot_checksum(a, f) - s) <= 1e-9 * (a.double().abs().sum() + f.double().abs().sum()).item()
                    for (_, a, f), s in zip(kept, sums))
    a_bf16 = compare_with_hf(setup.model_path, setup.capture_points, kept[:hf_batches], setup.data.train, plan,
                             job.hw.target_dtype, device.type)
    trainer_only = phase_trainer_only(factory, setup, plan, kept)
    del kept
    mem = {}
    if device.type == "cuda":
        trainers.clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with MemorySampler() as sampler:
            online = phase_online(job, factory, setup, plan)
        mem = memory_vs_plan(job, sampler)
    else:
        online = phase_online(job, factory, setup, plan)
    phases = {"target_only": target_only, "trainer_only": trainer_only, "online": online}
    slower = min(("target_only", "trainer_only"), key=lambda k: phases[k]["tokens_per_s"])
    res = {"phases": phases, "bottleneck": slower, "batches": len(plan),
           "ratio_online_over_min": online["tokens_per_s"] / phases[slower]["tokens_per_s"],
           "phase_a_checksums_ok": f"{copies_ok}/{len(sums)}", "memory": mem}
    return res, a_bf16, trainers[-1]


# ------------------------------------------------------------------------------ c) slot stress
def check_slots(job, setup, device: torch.device, n_batches: int, sleep_s: float, hf_batches: int):
    """Few slots, many batches, a slow consumer: the producer waits for every slot and overwrites it
    as soon as it comes back. Each trainer copy must carry the checksum the producer recorded."""
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, stream_slots=2))
    plan, steps = schedule(job, len(setup.data.train))
    plan = (plan * (n_batches // len(plan) + 1))[:n_batches]
    trainer = build_learner(job, setup, steps, device)
    captured, rows = [], []
    stream = make_target_stream(job, setup, setup.data.train, plan)
    with stream:
        for (msg, aux, final), ids in zip(stream, plan):
            if len(captured) < hf_batches:  # for a): raw states, copied before make_batch's sync
                captured.append((list(msg.lengths), aux.clone(), final.clone()))
            final_copy = final.to(device, torch.float32, copy=True)  # DraftBatch keeps the teacher, not final
            batch = trainer.make_batch([setup.data.train[i] for i in ids], msg.lengths, aux, final)
            stream.release(msg)
            time.sleep(sleep_s)  # the producer refills the slot meanwhile: a copy still tied to it would change
            got = slot_checksum(batch.aux_hidden, final_copy)
            scale = (batch.aux_hidden.double().abs().sum() + final_copy.double().abs().sum()).item()
            rows.append((msg.checksum, got, abs(got - msg.checksum) <= 1e-9 * max(scale, 1.0)))
    bad = [i for i, r in enumerate(rows) if not r[2]]
    distinct = len({round(r[0], 6) for r in rows})
    res = {"batches": len(rows), "slots": 2, "sleep_s": sleep_s, "mismatched_items": bad,
           "distinct_checksums": distinct, "ok": not bad and len(rows) == n_batches}
    return res, captured, plan


# ---------------------------------------------------------------------------- d) EAGLE-3 in SGLang
def check_spec(args, setup, trainer, export_dir: Path, size: dict) -> tuple[list[dict], dict]:
    """Rows per CUDA-graphs mode; a mode that raises is a row with its error (traceback in the dict)."""
    export_draft(trainer.draft, export_dir, setup.sglang_capture_ids, setup.info.bos_token_id, setup.info.eos_token_id,
                 capture_points=setup.capture_points)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(3, setup.info.vocab_size, (int(n),), generator=g).tolist() for n in (12, 20, 31, 24)]
    kw = dict(max_new_tokens=size["new_tokens"], device=args.device, dtype="float32", num_threads=args.threads,
              max_total_tokens=4096, mem_fraction_static=0.05 if args.device == "cuda" else 0.15, timeout_s=300)
    rows, errors = [], {}
    for graphs in ((False, True) if args.device == "cuda" else (False,)):
        kw["cuda_graph"] = graphs if args.device == "cuda" else None
        t0 = time.perf_counter()
        try:
            greedy = generate(setup.model_path, prompts, **kw)
            spec = generate(setup.model_path, prompts, draft_path=str(export_dir),
                            draft_args=setup.method.servings([[3, 1, 4]])[0].sglang_args, **kw)
        except Exception as err:  # noqa: BLE001 - the other mode still runs
            rows.append({"cuda_graph": graphs, "ok": False, "wall_s": time.perf_counter() - t0,
                         "error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"})
            errors[f"d graphs {'on' if graphs else 'off'}"] = traceback.format_exc()[-6000:]
            continue
        same = [a == b for a, b in zip(greedy.outputs, spec.outputs)]
        steps = sum(spec.verify_steps or [])
        rows.append({"cuda_graph": graphs, "prompts": len(prompts), "identical": sum(same),
                     "completion_tokens": sum(spec.completion_tokens), "verify_steps": steps,
                     "accept_length": sum(spec.completion_tokens) / steps if steps else None,
                     "engine_start_s": [greedy.start_s, spec.start_s],
                     "generate_s": [greedy.generate_s, spec.generate_s], "wall_s": time.perf_counter() - t0,
                     "ok": all(same) and sum(greedy.completion_tokens) > 0})
    return rows, errors


# ------------------------------------------------------------------------------------ the run
class Run:
    """Lines and JSON of one run. A check that raises is a FAIL line, with the last 25 lines of its
    traceback printed (all of it in the JSON), and the next check still runs; every check prints its wall
    time; the JSON is rewritten after each check (a run cut short keeps its lines)."""

    def __init__(self, args, out: Path):
        self.args, self.out, self.t0, self.lines = args, out, time.perf_counter(), []
        self.result = {"benchmark": "gpu_e2e", "args": vars(args), "errors": {}}

    def emit(self, status, text: str) -> None:
        status = status if isinstance(status, str) else ("PASS" if status else "FAIL")
        self.lines.append(f"{status} {text}")
        print(f"{status} {text}", flush=True)

    def error(self, name: str, trace: str) -> None:
        self.result["errors"][name] = trace[-6000:]
        print("\n".join(trace.rstrip().splitlines()[-25:]), flush=True)

    def check(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - reported, and the other checks still run
            first_line = str(err).splitlines()[0][:300] if str(err) else ""
            self.emit("FAIL", f"{name} raised {type(err).__name__}: {first_line}")
            self.error(name, traceback.format_exc())
        wall = self.result.setdefault("check_wall_s", {})[name] = time.perf_counter() - t0
        print(f"TIME {name}: {wall:.0f} s (run so far {time.perf_counter() - self.t0:.0f} s)", flush=True)
        self.save()

    def save(self) -> None:
        env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "TRITON_F32_DEFAULT", "PYTHONUNBUFFERED")}
        self.result.update(lines=self.lines, total_wall_s=time.perf_counter() - self.t0, machine=machine_info(**env),
                           ok=not any(ln.startswith("FAIL") for ln in self.lines))
        write_json(self.out, self.result)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    if args.device == "cuda":
        prepare_cuda_env()
    size, hf_batches = SIZES["small" if args.small else "gpu"], 2
    set_threads(args.threads)
    run = Run(args, args.out or default_out(args))
    res, device = run.result, torch.device("cuda:0" if args.device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory(prefix="specforge-gpu-e2e-") as tmp:
        model_path = build_random_target(Path(tmp, "target"), args.small, args.seed)
        vocab = (SMALL if args.small else SMOLLM2)["vocab_size"]
        samples = random_samples(size["samples"], size["lengths"], vocab, args.seed)
        job = make_job(args, model_path, size, "bfloat16")
        setup = make_setup(job, model_path, samples)
        state = {"trainer": None}
        if args.device == "cuda":
            row = SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"]
            res["jit"] = jit = jit_preflight([2 * row, 4 * row], tree="d" in args.checks)  # bf16, fp32 K/V rows
            for name, built in jit.items():
                run.emit("INFO" if built["built"] or name == "kv_store" else "FAIL",
                         f"SGLang JIT {name} kernel: " + (f"built in {built['seconds']} s" if built["built"] else
                                                          "NOT built" + (" (torch fallback)" if name == "kv_store"
                                                                         else "; d) cannot run")))
                if not built["built"]:
                    print(built["log"], flush=True)

        def b():
            res["b_stream"], res["a_hidden_bf16"], state["trainer"] = check_stream(job, setup, device, hf_batches)
            ph, r, m = res["b_stream"]["phases"], res["b_stream"], res["b_stream"]["memory"]
            run.emit(res["a_hidden_bf16"]["ok"], f"a) bf16 hidden states vs HF: {describe_a(res['a_hidden_bf16'])}")
            run.emit("PASS", f"b) online {ph['online']['tokens_per_s']:.0f} tok/s, target-only "
                             f"{ph['target_only']['tokens_per_s']:.0f}, trainer-only "
                             f"{ph['trainer_only']['tokens_per_s']:.0f}: online / min = "
                             f"{r['ratio_online_over_min']:.3f} ({r['batches']} batches)")
            if not m:
                return run.emit("SKIP", "b) peak memory vs the plan: the plan counts GPU memory only (CPU mode)")
            run.emit(m["ok"], f"b) peak device memory during online {m['device_peak_used'] / GiB:.2f} GiB <= plan "
                              f"{m['plan_total'] / GiB:.2f} GiB (target {m['plan_target'] / GiB:.2f}, trainer "
                              f"{m['plan_trainer'] / GiB:.2f}, ring {m['plan_ring'] / GiB:.3f}); trainer reserved "
                              f"{m['trainer_max_reserved'] / GiB:.2f} GiB")

        def a_and_c():
            job32 = make_job(args, model_path, size, "float32")
            c, captured, plan = check_slots(job32, setup, device, size["stress"], size["sleep"], hf_batches)
            res["c_slots"] = c
            res["a_hidden_fp32"] = a32 = compare_with_hf(model_path, setup.capture_points, captured, samples, plan,
                                                          "float32", args.device)
            run.emit(a32["ok"], f"a) fp32 hidden states vs HF: {describe_a(a32)}")
            run.emit(c["ok"], f"c) slot checksums: {c['batches'] - len(c['mismatched_items'])}/{c['batches']} trainer "
                              f"copies match the producer's ({c['slots']} slots, consumer sleeps {c['sleep_s']} s, "
                              f"{c['distinct_checksums']} distinct; phase A copies "
                              f"{res.get('b_stream', {}).get('phase_a_checksums_ok', 'n/a')})")

        def d():
            if state["trainer"] is None:  # b) did not run: an untrained head (d checks decoding, not AL)
                state["trainer"] = build_learner(make_job(args, model_path, size, "float32"), setup, 1, device)
            res["d_spec"], errors = check_spec(args, setup, state["trainer"], Path(tmp, "export"), size)
            for r in res["d_spec"]:
                mode = f"d) EAGLE-3 3/1/4 in SGLang, CUDA graphs {'on' if r['cuda_graph'] else 'off'}"
                if "error" in r:
                    run.emit("FAIL", f"{mode} raised {r['error']} ({r['wall_s']:.0f} s)")
                    continue
                run.emit(r["ok"], f"{mode}: speculative == greedy for {r['identical']}/{r['prompts']} prompts "
                                  f"({r['completion_tokens']} tokens, accept length {r['accept_length'] or 0:.2f}, "
                                  f"{r['wall_s']:.0f} s)")
            for name, trace in errors.items():
                run.error(name, trace)
            if args.device != "cuda":
                run.emit("SKIP", "d) CUDA graphs on: no CUDA on CPU")

        for name, fn, wanted in (("b", b, "b"), ("a+c", a_and_c, "ac"), ("d", d, "d")):
            if any(k in args.checks for k in wanted):
                run.check(name, fn)
    run.save()
    print(f"{'ALL PASS' if res['ok'] else 'SOME FAILED'} in {res['total_wall_s']:.0f} s", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
