"""One draft training step at Kimi-K2.5 shapes on one GPU: time, peak memory, TFLOP/s. EAGLE-3 by
default; `--methods dflash,eagle3` adds one DFlash layer (conf/draft/kimi_dflash.yaml with num_layers=1:
its six capture points, block 8, 512 anchors; the plan counts a DFlash "step" as one layer) against the
plan of draft/dflash/plan.py, each method's rows written as soon as they exist.

The step is the trainer's own (train/learner.py `DraftLearner`): make_batch (pad + chunked teacher
over the full 163840-token vocab) -> train_micro (TTT forward + backward, bf16 autocast) ->
optimizer_step (grad clip + AdamW + LR schedule). Random tensors stand in for the target's hidden
states (aux [N, 3*7168], final [N, 7168], bf16 as the stream carries them on GPU). The frozen
embedding and lm_head are kept in bf16 under bf16 autocast (fp32 with --no-bf16), as
train/trainer.py keeps them in hw.target_dtype. --activation-checkpointing and --optimizer-device
(e.g. cpu: OffloadedAdamW with master weights and m/v in host memory) measure the settings of
conf/hw/rtxpro6000x8.yaml (train.activation_checkpointing, train.optimizer_device).

Shapes: the draft of conf/draft/kimi.yaml (read from the file) on the Kimi-K2.5 target facts of
specforge_k25.plan (hidden 7168, vocab 163840): 56 heads / 8 KV heads, head_dim 128, I 18432,
Vd 32000; ttt_length 7; T 2048, 4096, 8192 (one sequence per step).

Reported per T: median step time after warm-up and its phases (teacher / fwd+bwd / optimizer,
CUDA-synchronised between phases), torch.cuda.max_memory_allocated over the shape (setup
included: weights, AdamW state, step transients) beside the memory planner's figure for the
same step and settings (frozen dtype, checkpointing, optimizer offload), and achieved TFLOP/s =
analytic FLOPs / median step time, against the bf16 (and fp32) matmul rate measured in the same
process. A shape that runs out of memory is reported as OOM. The table is printed last.

    python benchmarks/gpu_kimi_shapes.py                      # CUDA, Kimi shapes (<= ~5 min on one H200)
    python benchmarks/gpu_kimi_shapes.py --activation-checkpointing --optimizer-device cpu  # RTX PRO 6000 profile
    python benchmarks/gpu_kimi_shapes.py --device cpu --small # tiny shapes, seconds (smoke test)
    python benchmarks/gpu_kimi_shapes.py --methods dflash,eagle3 --seq-lens 2048,4096 --iters 3  # in the GPU check

FLOP count: `specforge_k25.plan.throughput.draft_step_flops` (its docstring; the throughput plan
uses the same count). It equals torch.utils.flop_counter's count of the same step exactly, its
SDPA formulas included (tests/benchmarks/test_benchmarks.py; on CPU the flash kernel for CPU is
counted with torch's flash-attention formulas).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path

import torch

from _common import RESULTS, GiB, machine_info, set_threads, write_json
from gpu_kimi_report import plot, print_report
from specforge_k25.plan.throughput import draft_step_flops as step_flops  # one FLOP count: the plan's

REPO = Path(__file__).resolve().parent.parent
KIMI_DRAFT_YAML = REPO / "conf" / "draft" / "kimi.yaml"
DEFAULT_OUT = RESULTS / "gpu_kimi_shapes.json"
KIMI_DFLASH_YAML = REPO / "conf" / "draft" / "kimi_dflash.yaml"
KIMI_DFLASH_AUX = 6  # its capture points [2,13,25,36,48,59] (the YAML's comment)
# --small: a draft of the same structure (GQA 2:1, Vd < V), sized for a CPU smoke test
SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=1024, draft_vocab_size=256, target_hidden_size=64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test; any device)")
    p.add_argument("--seq-lens", default=None, help="comma-separated T (default 2048,4096,8192; --small: 32,64)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--teacher-chunk", type=int, default=1024, help="positions per teacher chunk (train.teacher_chunk)")
    p.add_argument("--no-bf16", action="store_true",
                   help="fp32 compute instead of bf16 autocast (and fp32 frozen embedding / lm_head instead of bf16)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each TTT step in backward (train.activation_checkpointing)")
    p.add_argument("--optimizer-device", default=None,
                   help="AdamW master weights and m/v on this device, e.g. cpu or cuda:1 (train.optimizer_device); "
                        "default: on --device")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per shape")
    p.add_argument("--iters", type=int, default=5, help="timed steps per shape")
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n x n x n rate check (default 8192; --small: 256)")
    p.add_argument("--time-budget-s", type=float, default=240.0,
                   help="shapes not started within this many seconds are reported as skipped")
    p.add_argument("--threads", type=int, default=2, help="CPU intra-op threads")
    p.add_argument("--methods", default="eagle3", help="comma-separated: eagle3, dflash (one layer)")
    p.add_argument("--no-plot", action="store_true", help="no PNG (the device tool brings back few files)")
    p.add_argument("--out", type=Path, default=None, help="JSON result, the PNG beside it (default: "
                                                          "$OUT/gpu_kimi_shapes.json where OUT is set, else "
                                                          "benchmarks/results/gpu_kimi_shapes.json)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ shapes
def draft_config(small: bool, method: str = "eagle3"):
    """The Kimi draft exactly as a run with `target=kimi_k25 draft=kimi` builds it (or a tiny one).
    Plain YAML (no OmegaConf): the GPU machines' images lack it, and conf/draft/kimi.yaml has no
    interpolation."""
    import yaml

    from specforge_k25.draft.eagle3.config import Eagle3Spec
    from specforge_k25.draft.eagle3.model import DraftConfig
    from specforge_k25.plan import KIMI_K25, resolve_draft

    if method == "dflash":
        return dflash_config(small)
    if small:
        return DraftConfig(**SMALL_SHAPE, max_position_embeddings=4096)
    spec = Eagle3Spec()  # conf/draft/kimi.yaml: EAGLE-3's defaults (its `defaults:` list) and its sizes
    for key, value in yaml.safe_load(Path(KIMI_DRAFT_YAML).read_text()).items():
        if key != "defaults":
            setattr(spec, key, value)
    return resolve_draft(spec, KIMI_K25)


def dflash_spec():
    """conf/draft/kimi_dflash.yaml over DFlash's defaults, one layer."""
    import yaml

    from specforge_k25.draft.dflash.config import DFlashSpec

    spec = DFlashSpec()
    for key, value in yaml.safe_load(KIMI_DFLASH_YAML.read_text()).items():
        if key != "defaults":
            setattr(spec, key, value)
    spec.num_layers = 1
    return spec


def dflash_config(small: bool):
    from specforge_k25.draft.dflash.model import DFlashConfig
    from specforge_k25.plan import KIMI_K25, resolve_draft

    if small:
        return DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=1024, target_hidden_size=64,
                            num_aux_hidden_states=KIMI_DFLASH_AUX, block_size=8, mask_token_id=1023, num_anchors=8,
                            max_position_embeddings=4096)
    return resolve_draft(dflash_spec(), KIMI_K25, KIMI_DFLASH_AUX)


def planned_bytes(cfg, batch: int, seq_len: int, ttt_length: int, chunk: int, bf16: bool, *, checkpoint: bool,
                  optimizer_offloaded: bool) -> int:
    """The memory planner's trainer figure for this step (same settings as `build_learner`: frozen
    embedding / lm_head in bf16 under bf16 autocast, else fp32), without the CUDA context."""
    from specforge_k25.plan import trainer_items

    from specforge_k25.draft.registry import method_of_config

    items = trainer_items(cfg, method=method_of_config(cfg), batch=batch, seq_len=seq_len, ttt_length=ttt_length, teacher_chunk=chunk, bf16=bf16,
                          data_parallel=False, context_bytes=0, frozen_bytes=frozen_dtype(bf16).itemsize,
                          checkpoint=checkpoint, optimizer_offloaded=optimizer_offloaded)
    resident = sum(i.bytes for i in items if i.phase is None)
    phases: dict[str, int] = {}
    for i in items:
        if i.phase is not None:
            phases[i.phase] = phases.get(i.phase, 0) + i.bytes
    return resident + max(phases.values(), default=0)


# ----------------------------------------------------------------------------------- devices
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (fp32 under the current TF32 setting)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    iters, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10):
            a @ b
        iters += 10
        sync(device)
        if time.perf_counter() - t0 >= seconds:
            break
    rate = 2 * n**3 * iters / (time.perf_counter() - t0)
    del a, b
    free_memory(device)
    return rate


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# -------------------------------------------------------------------------------------- step
def frozen_dtype(bf16: bool) -> torch.dtype:
    """dtype of the frozen embedding and lm_head: the target's (train/learner.py build_learner keeps
    them in hw.target_dtype, bfloat16 for the bf16-autocast profiles); fp32 with --no-bf16."""
    return torch.bfloat16 if bf16 else torch.float32


def optimizer_device(args, device: torch.device) -> str | None:
    """--optimizer-device as build_optimizer's `device`: None when it names the trainer's own device."""
    name = args.optimizer_device
    if name in (None, "", "none"):
        return None
    want = torch.device(name)

    def index(d: torch.device):
        return d.index if d.index is not None or d.type != "cuda" else torch.cuda.current_device()

    return None if (want.type, index(want)) == (device.type, index(device)) else name


def build_learner(cfg, device: torch.device, args):
    from specforge_k25.train.optim import build_optimizer, build_scheduler
    from specforge_k25.draft.registry import method_of_config
    from specforge_k25.train.learner import DraftLearner

    frozen = frozen_dtype(not args.no_bf16)
    method = method_of_config(cfg)
    torch.manual_seed(0)
    with torch.device(device):  # initialise the 2B-parameter module where it lives
        draft = method.new_model(cfg)
        draft.embed_tokens.to(frozen)  # before the lm_head exists: the fp32 -> bf16 transient stays small
        lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, dtype=frozen).mul_(cfg.target_hidden_size**-0.5)
    # d2t = 0: draft ids 0..Vd-1 are target ids 0..Vd-1 (which ids does not change the cost)
    optimizer = build_optimizer(draft.trainable_parameters(), 5e-5, (0.9, 0.95), 0.0,
                                device=optimizer_device(args, device))
    scheduler = build_scheduler(optimizer, 1000, 0.015)
    spec = dflash_spec() if method.name == "dflash" else method.spec_class(ttt_length=args.ttt_length)
    return DraftLearner(method, draft, lm_head, optimizer, scheduler, spec=spec,
                        grad_accum=1, grad_clip=0.5, teacher_chunk=args.teacher_chunk, autocast_bf16=not args.no_bf16,
                        activation_checkpointing=args.activation_checkpointing)


def random_inputs(cfg, batch: int, seq_len: int, device: torch.device):
    """What the stream hands the trainer: samples (ids + loss masks), packed aux / final hidden states."""
    from specforge_k25.data.tokenize import Sample

    samples = []
    for _ in range(batch):
        ids = torch.randint(0, cfg.vocab_size, (seq_len,))
        mask = torch.ones(seq_len, dtype=torch.bool)
        mask[: seq_len // 8] = False  # a short prompt
        samples.append(Sample(ids, mask))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from specforge_k25.draft.registry import method_of_config

    N, Ht = batch * seq_len, cfg.target_hidden_size
    aux = torch.randn(N, method_of_config(cfg).num_aux(cfg) * Ht, device=device, dtype=dtype)
    final = torch.randn(N, Ht, device=device, dtype=dtype)
    return samples, [seq_len] * batch, aux, final


def timed_step(trainer, inputs, device: torch.device) -> dict:
    samples, lengths, aux, final = inputs
    sync(device)
    t0 = time.perf_counter()
    batch = trainer.make_batch(samples, lengths, aux, final)
    sync(device)
    t1 = time.perf_counter()
    res = trainer.train_micro(batch)
    sync(device)
    t2 = time.perf_counter()
    grad_norm = trainer.optimizer_step()  # float(): synchronises
    t3 = time.perf_counter()
    return {"step_s": t3 - t0, "teacher_s": t1 - t0, "fwd_bwd_s": t2 - t1, "optim_s": t3 - t2,
            "loss": float(res.loss.detach()), "grad_norm": grad_norm}


def run_shape(cfg, seq_len: int, device: torch.device, args) -> dict:
    trainer = build_learner(cfg, device, args)
    inputs = random_inputs(cfg, args.batch, seq_len, device)
    sync(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    steps = [timed_step(trainer, inputs, device) for _ in range(args.warmup + args.iters)][args.warmup:]
    out = {"status": "ok", "resident_bytes": resident, "peak_bytes": peak_bytes(device)}
    for key in ("step_s", "teacher_s", "fwd_bwd_s", "optim_s"):
        out[key] = statistics.median(s[key] for s in steps)
    out["step_s_all"] = [s["step_s"] for s in steps]
    out["loss_last"], out["grad_norm_last"] = steps[-1]["loss"], steps[-1]["grad_norm"]
    return out


def measure_shape(cfg, seq_len: int, device: torch.device, args) -> dict:
    """run_shape, with an out-of-memory error reported as status OOM instead of raised."""
    free_memory(device)
    reset_peak(device)
    try:
        result = run_shape(cfg, seq_len, device, args)
    except Exception as err:  # noqa: BLE001 - only OOM is swallowed
        if not is_oom(err):
            raise
        result = {"status": "OOM", "error": str(err).strip().splitlines()[0][:300], "peak_bytes": peak_bytes(device)}
    free_memory(device)
    return result


# ------------------------------------------------------------------------------------ report
def add_rates(row: dict, flops: dict, bf16_rate: float, fp32_rate: float, teacher_bf16: bool) -> None:
    """teacher_bf16: the teacher matmul runs in bf16 (lm_head's dtype), else fp32."""
    if row["status"] != "ok":
        return
    row["tflop_per_step"] = flops["total"] / 1e12
    row["tflops"] = flops["total"] / row["step_s"] / 1e12
    row["frac_of_bf16_matmul"] = flops["total"] / row["step_s"] / bf16_rate
    draft = flops["draft_fwd"] + flops["draft_bwd"] + flops["draft_recompute"]
    row["draft_tflops"] = draft / row["fwd_bwd_s"] / 1e12
    row["teacher_tflops"] = flops["teacher"] / row["teacher_s"] / 1e12
    # against the matmul rate of the dtype the teacher runs in
    row["teacher_frac_of_matmul"] = flops["teacher"] / row["teacher_s"] / (bf16_rate if teacher_bf16 else fp32_rate)


def default_out() -> Path:
    """$OUT where the device tool sets it: only what is written there comes back."""
    return Path(os.environ["OUT"]) / "gpu_kimi_shapes.json" if os.environ.get("OUT") else DEFAULT_OUT


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out = args.out or default_out()
    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device wants an index (torch 2.11)
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --small for the smoke mode")
    methods = args.methods.split(",")
    if set(methods) - {"eagle3", "dflash"}:
        raise SystemExit(f"--methods: eagle3 and/or dflash, not {args.methods}")
    seq_lens = [int(t) for t in (args.seq_lens or ("32,64" if args.small else "2048,4096,8192")).split(",")]
    n_mm = args.matmul_size or (256 if args.small else 8192)
    t_start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device_name}; T {seq_lens}; methods {methods}", flush=True)

    bf16_rate = matmul_rate(device, n_mm, torch.bfloat16, seconds=0.3 if args.small else 2.0)
    fp32_rate = matmul_rate(device, n_mm, torch.float32, seconds=0.3 if args.small else 2.0)
    print(f"matmul {n_mm}^3: bf16 {bf16_rate / 1e12:.1f} TFLOP/s, fp32 {fp32_rate / 1e12:.1f} TFLOP/s", flush=True)

    from specforge_k25.plan import trainable_params

    bf16 = not args.no_bf16
    opt_device = optimizer_device(args, device)
    results = {}

    def save():  # after every shape: a run cut short keeps its rows
        write_json(args.out, results[methods[0]] if len(methods) == 1 else
                   {"benchmark": "gpu_kimi_shapes", "methods": results, "args": vars(args)}, quiet=True)

    for name in methods:
        cfg = draft_config(args.small, name)
        print(f"{name}: draft {cfg}", flush=True)
        shapes = []
        results[name] = result = {
            "benchmark": "gpu_kimi_shapes", "method": name, "device_name": device_name,
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
            "draft": dataclasses.asdict(cfg), "trainable_params": trainable_params(cfg),
            "matmul": {"n": n_mm, "bf16_tflops": bf16_rate / 1e12, "fp32_tflops": fp32_rate / 1e12,
                       "fp32_allow_tf32": torch.backends.cuda.matmul.allow_tf32},
            "memory_method": ("torch.cuda.max_memory_allocated over the shape (setup + warm-up + timed steps)"
                              if device.type == "cuda" else "not measured on CPU"),
            "flop_method": ("analytic, specforge_k25.plan.throughput.draft_step_flops, the method's own count "
                            "(EAGLE-3: per TTT step one causal SDPA, counted as full QK^T and PV, over T keys at step "
                            "0 and T+1 with the sink column after; backward 2.5x its forward; DFlash: "
                            "draft/dflash/plan.py)"),
            "frozen_dtype": str(frozen_dtype(bf16)).removeprefix("torch."), "optimizer_device": opt_device,
            "shapes": shapes, "args": vars(args), "machine": machine_info(threads=args.threads),
        }
        for T in seq_lens:
            flops = step_flops(cfg, args.batch, T, args.ttt_length, checkpoint=args.activation_checkpointing)
            planned = planned_bytes(cfg, args.batch, T, args.ttt_length, args.teacher_chunk, bf16,
                                    checkpoint=args.activation_checkpointing, optimizer_offloaded=opt_device is not None)
            if time.perf_counter() - t_start > args.time_budget_s:
                row = {"status": "skipped (time budget)"}
            else:
                print(f"{name} T={T}: planner says {planned / GiB:.1f} GiB ...", flush=True)
                row = measure_shape(cfg, T, device, args)
            row.update(seq_len=T, flops=flops, planned_bytes=planned)
            if row.get("peak_bytes") and row["status"] == "ok":
                row["peak_over_plan"] = row["peak_bytes"] / planned
            add_rates(row, flops, bf16_rate, fp32_rate, teacher_bf16=bf16)
            print(f"{name} T={T}: {row['status']}" + (f", {row['step_s']:.3f} s/step" if row["status"] == "ok" else "")
                  + (f", peak / plan {row['peak_over_plan']:.2f}" if "peak_over_plan" in row else ""), flush=True)
            shapes.append(row)
            result["total_wall_s"] = time.perf_counter() - t_start
            save()
    print(f"wrote {args.out}")
    if not args.no_plot:
        for name in methods:
            plot(results[name], args.out.with_name(args.out.stem + ("" if len(methods) == 1 else f"_{name}") + ".png"))
    for name in methods:
        print_report(results[name])  # last
    return results[methods[0]] if len(methods) == 1 else {"methods": results}


if __name__ == "__main__":
    main()
