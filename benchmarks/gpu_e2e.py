"""The production path on one GPU, end to end: SGLang target, CUDA slot ring, trainer, SGLang's own
speculative decoding with heads of every draft method.

On the device machine it runs as steps of benchmarks/gpu_check.py (the one device command,
docs/PERFORMANCE.md section 7), each its own process with its own timeout (`--checks c`, `d`, `e`, `b`),
all writing into one JSON (`--out $OUT/gpu_e2e.json --merge`), rewritten after every sub-result.
Alone: `python benchmarks/gpu_e2e.py --device cuda` (all checks); results go to $OUT/gpu_e2e[_<checks>].json
where the device tool sets OUT, else docs/gpu_h200/ (cuda) or benchmarks/results/gpu_e2e_cpu.json (cpu).
CPU mode (tests/benchmarks/test_benchmarks.py runs it): python benchmarks/gpu_e2e.py --device cpu --small

A SmolLM2-135M-shaped Llama with random weights is built in a temp folder (--small: 8 layers, hidden
64), with a word-level tokenizer; the samples are random token ids. One line per result:
  a) captured aux/final hidden states == HF transformers on the same device: fp32 within 1e-4 x
     max(1, |ref|); bf16 no further from HF fp32 than HF's own bf16 is (x2, at least one bf16 ulp);
  b) engine and trainer on one device through the ring (benchmarks/stream.py's phases, >= 200 batches
     on CUDA): target-only, trainer-only and online tokens/s (window and median per batch), online / min
     of the two, the kernel set SGLang ran (torch-native stand-ins or sgl_kernel); on CUDA device memory
     measured / planned per owner (trainer process, target processes, device), within [0.5, 1];
  c) slot hand-off (benchmarks/gpu_handoff.py): 2 slots, many batches, the consumer's CUDA stream
     delayed before each copy; every trainer copy's checksum equals the producer's; a planted no-sync
     half must lose batches (the check's power);
  d) SGLang's EAGLE-3 (chain 3/1/4) with the head trained in b) (untrained when b does not run in the
     same process), CUDA graphs off and on (CPU: off); e) DFlash (block 4) and MLA EAGLE-3, untrained:
     speculative == greedy and SGLang's verify steps == our replay (benchmarks/gpu_spec.py).
Every engine has a timeout from --deadline (the check's global one); what has no time left is SKIP.
Before any engine (benchmarks/gpu_preflight.py prepare_env): TRITON_F32_DEFAULT=ieee on CUDA, the
Python radix tree core, CUDA_HOME usable by SGLang's JIT.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import gpu_handoff
import gpu_spec
import stream as stream_bench
from _common import GiB, MiB, RESULTS, machine_info, set_threads, write_json
from _gpu_device import MemorySampler, memory_vs_plan
from gpu_handoff import check_slots, schedule
from gpu_targets import SMALL, SMOLLM2
from gpu_preflight import prepare_env
from stream import PhaseClock, phase_online, phase_trainer_only
from specforge_k25.config import JobConfig
from specforge_k25.data.dataset import TokenizedData
from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.registry import method_of_spec
from specforge_k25.plan import facts_from_folder, plan_memory, resolve_draft
from specforge_k25.setup.run import RunSetup
from specforge_k25.setup.target import make_target_stream
from specforge_k25.stream.ring import slot_checksum
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import layer_id_rule, resolve_capture_points, sglang_layer_ids
from specforge_k25.train.learner import build_learner

ROOT = Path(__file__).resolve().parents[1]
GPU_OUT = ROOT / "docs" / "gpu_h200" / "gpu_e2e.json"
# sizes per mode: samples, tokens per sample (min, max), batch size, draft vocab, TTT steps, stress batches
# gpu: 800 samples at batch 4 = 200 batches per phase, each timed (medians over >= 200 items)
SIZES = {"gpu": dict(samples=800, lengths=(128, 640), batch=4, draft_vocab=32000, ttt=7, stress=120, sleep=0.01,
                     max_total_tokens=8192, new_tokens=48),
         "small": dict(samples=24, lengths=(24, 80), batch=2, draft_vocab=256, ttt=3, stress=16, sleep=0.05,
                       max_total_tokens=2048, new_tokens=16)}


def default_out(args) -> Path:
    """$OUT where the device tool sets it: only what is written there comes back from the machine."""
    name = "gpu_e2e.json" if sorted(args.checks) == list("abcd") else f"gpu_e2e_{args.checks}.json"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return GPU_OUT.parent / name if args.device == "cuda" else RESULTS / "gpu_e2e_cpu.json"


def prepare_cuda_env(tmp: Path | None = None) -> dict:
    """Before any engine: every engine process inherits these, and triton reads TRITON_F32_DEFAULT when it
    compiles (SGLang's triton attention calls tl.dot with no input precision: TF32 in fp32 on GPUs);
    PYTHONUNBUFFERED keeps the engines' output in order in a log cut short; the Python radix tree core and
    a CUDA_HOME the JIT can link against (gpu_preflight.prepare_env)."""
    return prepare_env(os.environ, Path(tmp or tempfile.mkdtemp(prefix="specforge-cuda-home-")), cuda=True)


def kernel_set(device: str) -> str:
    """Which kernels SGLang ran: b)'s throughput means something different for each."""
    if device != "cuda":
        return "cpu: SGLang's CPU paths, torch_native attention"
    if importlib.util.find_spec("sgl_kernel") is None:
        return ("torch-native stand-ins: no sgl_kernel (RMSNorm, SiluAndMul, rope in torch: "
                "SGLANG_FORCE_FUSED_OP_BACKEND=torch), triton attention")
    from importlib.metadata import version

    return f"real: sgl_kernel {version('sglang-kernel')}, attention {os.environ.get('SPECFORGE_ATTENTION', 'default')}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="a much smaller Llama and data (the CPU mode)")
    p.add_argument("--checks", default="abcd", help="which checks to run, of abcde (b trains the head d serves, if "
                                                    "both run; e serves DFlash and MLA EAGLE-3)")
    p.add_argument("--deadline", type=float, default=None, help="epoch seconds: engines get no time past it")
    p.add_argument("--engine-timeout", type=float, default=None, help="seconds per SGLang engine (default 150 on "
                                                                      "cuda, 600 on cpu)")
    p.add_argument("--merge", action="store_true", help="add to the JSON at --out (other checks' results kept)")
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
    tr.stream_timeout_s, tr.engine_start_timeout_s = (120.0, 150.0) if args.device == "cuda" else (300.0, 600.0)
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
class MedianClock(PhaseClock):
    """benchmarks/stream.py's clock, plus the median over batches of each batch's tokens / its time."""

    def result(self, **extra) -> dict:
        res = super().result(**extra)
        rates = [n / (b - a) for n, a, b in zip(self.tokens[1:], self.done, self.done[1:]) if b > a]
        res["tokens_per_s_median"] = statistics.median(rates) if rates else float("nan")
        res["timed_items"] = len(rates)
        return res


def phase_target_only(job, setup, plan) -> tuple[dict, list, list]:
    """benchmarks/stream.py's phase A, with the copies finished before each slot goes back (its own
    version releases right after enqueuing the clones: safe on CPU, a race on CUDA)."""
    kept, sums = [], []
    stream = make_target_stream(job, setup, setup.data.train, plan)
    clock = MedianClock("target_only")
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
        gc.collect()  # the trainer-only phase's learner and tensors are garbage only once collected
        # no empty_cache here: what the allocator still caches is what a real run's target sees as used
        torch.cuda.reset_peak_memory_stats()
        with MemorySampler() as sampler:
            online = phase_online(job, factory, setup, plan)
        mem = memory_vs_plan(job, sampler, os.getpid())
    else:
        online = phase_online(job, factory, setup, plan)
    phases = {"target_only": target_only, "trainer_only": trainer_only, "online": online}
    slower = min(("target_only", "trainer_only"), key=lambda k: phases[k]["tokens_per_s"])
    res = {"phases": phases, "bottleneck": slower, "batches": len(plan),
           "ratio_online_over_min": online["tokens_per_s"] / phases[slower]["tokens_per_s"],
           "phase_a_checksums_ok": f"{copies_ok}/{len(sums)}", "memory": mem}
    return res, a_bf16, trainers[-1]


# ------------------------------------------------------------------------------------ the run
class Run:
    """Lines and JSON of one run. A check that raises is a FAIL line, with the last 25 lines of its
    traceback printed (all of it in the JSON), and the next check still runs; every check prints its wall
    time; the JSON is rewritten after every result (`put`), so a run killed mid-check keeps what it had.
    With --merge the JSON at `out` is read first and this run's results are added to it."""

    def __init__(self, args, out: Path):
        self.args, self.out, self.t0, self.lines = args, out, time.perf_counter(), []
        old = json.loads(out.read_text()) if args.merge and out.is_file() else {}
        self.result = {**old, "benchmark": "gpu_e2e", "args": vars(args), "errors": old.get("errors", {})}
        self.earlier = old.get("lines", [])
        self.result.setdefault("runs", {})[args.checks] = {"lines": self.lines, "running": True}

    def put(self, key: str, value) -> None:
        self.result[key] = value
        self.save()

    def emit(self, status, text: str) -> None:
        status = status if isinstance(status, str) else ("PASS" if status else "FAIL")
        self.lines.append(f"{status} {text}")
        print(f"{status} {text}", flush=True)
        self.save()

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

    def save(self, done: bool = False) -> None:
        env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "TRITON_F32_DEFAULT", "PYTHONUNBUFFERED",
                                              "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "CUDA_HOME")}
        lines = self.earlier + self.lines
        self.result["runs"][self.args.checks].update(total_wall_s=time.perf_counter() - self.t0, running=not done)
        self.result.update(lines=lines, total_wall_s=time.perf_counter() - self.t0, machine=machine_info(**env),
                           ok=not any(ln.startswith("FAIL") for ln in lines))
        write_json(self.out, self.result, quiet=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    size, hf_batches = SIZES["small" if args.small else "gpu"], 2
    set_threads(args.threads)
    run = Run(args, args.out or default_out(args))
    res, device = run.result, torch.device("cuda:0" if args.device == "cuda" else "cpu")
    engine_timeout = args.engine_timeout or (150.0 if args.device == "cuda" else 600.0)
    saved_env = dict(os.environ)
    try:
        return _run(args, run, res, device, size, hf_batches, engine_timeout)
    finally:  # what prepare_env set is this run's (a caller in the same process keeps its own)
        os.environ.clear()
        os.environ.update(saved_env)


def _run(args, run: Run, res: dict, device: torch.device, size: dict, hf_batches: int, engine_timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="specforge-gpu-e2e-") as tmp:
        if args.device == "cuda":
            res["env_prepared"] = prepare_cuda_env(Path(tmp))
        else:  # the CPU engines take the same radix tree core as the device's
            os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
        model_path = build_random_target(Path(tmp, "target"), args.small, args.seed)
        vocab = (SMALL if args.small else SMOLLM2)["vocab_size"]
        samples = random_samples(size["samples"], size["lengths"], vocab, args.seed)
        job = make_job(args, model_path, size, "bfloat16")
        setup = make_setup(job, model_path, samples)
        state = {"trainer": None}

        def b():
            stream_bench.PhaseClock = MedianClock  # medians per batch in every phase
            b_res, a_bf16, state["trainer"] = check_stream(job, setup, device, hf_batches)
            b_res["kernels"] = kernel_set(args.device)
            res["a_hidden_bf16"] = a_bf16
            run.put("b_stream", b_res)
            ph, r, m = b_res["phases"], b_res, b_res["memory"]
            run.emit(a_bf16["ok"], f"a) bf16 hidden states vs HF: {describe_a(a_bf16)}")
            run.emit("PASS", f"b) online {ph['online']['tokens_per_s']:.0f} tok/s, target-only "
                             f"{ph['target_only']['tokens_per_s']:.0f}, trainer-only "
                             f"{ph['trainer_only']['tokens_per_s']:.0f}: online / min = "
                             f"{r['ratio_online_over_min']:.3f} ({r['batches']} batches; medians per batch "
                             f"{ph['online'].get('tokens_per_s_median', float('nan')):.0f} / "
                             f"{ph['target_only'].get('tokens_per_s_median', float('nan')):.0f} / "
                             f"{ph['trainer_only'].get('tokens_per_s_median', float('nan')):.0f}; kernels: "
                             f"{b_res['kernels'].split(':')[0]})")
            if not m:
                return run.emit("SKIP", "b) peak memory vs the plan: the plan counts GPU memory only (CPU mode)")
            for owner, row in m["owners"].items():
                got = "not measured" if row["measured"] is None else f"{row['measured'] / GiB:.2f} GiB"
                ratio = "" if row["ratio"] is None else f" = {row['ratio']:.2f}"
                run.emit("INFO" if row["ok"] is None else row["ok"],
                         f"b) memory {owner}: measured {got} / plan {row['planned'] / GiB:.2f} GiB{ratio} "
                         f"(bounds {m['bounds'][0]}-{m['bounds'][1]}; {m['source'].split(':')[0]})")

        def a_and_c():
            job32 = make_job(args, model_path, size, "float32")
            c, captured, plan = check_slots(job32, setup, device, size["stress"], size["sleep"], hf_batches)
            run.put("c_slots", c)
            a32 = compare_with_hf(model_path, setup.capture_points, captured, samples, plan, "float32", args.device)
            run.put("a_hidden_fp32", a32)
            run.emit(a32["ok"], f"a) fp32 hidden states vs HF: {describe_a(a32)}")
            run.emit(c["ok"], gpu_handoff.describe(c))

        def serve(check: str, names: list[str], key: str):
            heads = {}
            for name in names:
                job_m = make_job(args, model_path, size, "float32")
                job_m.draft = gpu_spec.method_spec(name, size)
                setup_m = make_setup(job_m, model_path, samples)
                if name == "eagle3" and state["trainer"] is not None:  # the head b) trained
                    heads[name] = (setup_m, state["trainer"].draft)
                else:  # untrained: the check is the decoding and the replay, not the acceptance
                    heads[name] = (setup_m, build_learner(job_m, setup_m, 1, device).draft)
            modes = {n: ([False, True] if args.device == "cuda" and n == "eagle3" else [False]) for n in names}

            def on_row(row):
                res.setdefault(key, []).append(row)
                run.emit(*gpu_spec.describe(row, check))

            res[key] = []
            _, errors = gpu_spec.serve(args, heads, Path(tmp, f"export_{check}"), size, modes, args.deadline,
                                       engine_timeout, on_row)
            for name, trace in errors.items():
                run.error(f"{check} {name}", trace)
            if args.device != "cuda" and check == "d":
                run.emit("SKIP", "d) CUDA graphs on: no CUDA on CPU")

        for name, fn, wanted in (("b", b, "b"), ("a+c", a_and_c, "ac"),
                                 ("d", lambda: serve("d", ["eagle3"], "d_spec"), "d"),
                                 ("e", lambda: serve("e", ["dflash", "eagle3_mla"], "e_spec"), "e")):
            if any(k in args.checks for k in wanted):
                run.check(name, fn)
    run.save(done=True)
    print(f"{'ALL PASS' if res['ok'] else 'SOME FAILED'} in {res['total_wall_s']:.0f} s; wrote {run.out}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
