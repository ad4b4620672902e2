"""Regeneration: capture the hidden states during decoding, or prefill prompt + answer afterwards?

With `data.regenerate=true` the target answers each prompt with SGLang's own extend/decode steps
(`SGLangTarget.generate`) and then prefills prompt + answer (`SGLangTarget.forward`) to capture the
aux / final hidden states (`regenerate` in stream/target_process.py). The alternative keeps the states the
text model already computes while generating: the extend step gives the prompt tokens' states, each
decode step the state of the token fed in; no second pass.

One SGLangTarget in this process (embedded SmolLM2, fp32, CPU), N chat prompts (MT-bench's first
questions, rendered with the chat template), up to M new tokens each, greedy, in one group:

  generate  `target.generate(prompts, budgets, Regeneration(...))`, an extra forward hook on the
            text module the engine hooks recording every extend / decode output (and the ids and
            positions fed in, to check the assembly);
  prefill   `target.forward(conversations)` of the same prompt + answer ids, in one packed batch.

Throughput: prefill time / generation time is the cost of prefilling afterwards (the prefill design
runs regeneration at generate / (generate + prefill) of the capture design's speed); tokens/s of
both. Exactness, per element max |diff| / (1e-4 * max(1, |prefill|)) (<= 1: fp32 agreement, the
bound of tests/target_engine/test_target.py), for aux and final, against the packed prefill:

  prefill again          the same batch once more (the prefill design: exact by construction)
  prefill alone          each conversation prefilled on its own (batch composition alone)
  decode capture         prompt rows from the extend + one row per fed answer token (the last token
                         of an answer is never fed: only positions both have are compared),
                         overall, prompt rows, answer rows, and the worst position.

Prints two tables and writes JSON (benchmarks/results/regeneration.json). No assertion on any number.

    .venv/bin/python benchmarks/regeneration.py                  # N=8, M=64: ~1.5 min on 1 busy core
    .venv/bin/python benchmarks/regeneration.py --smoke          # N=2, M=4 (the smoke test)
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from _common import RESULTS, machine_info, print_table, set_threads, write_json

DEFAULT_OUT = RESULTS / "regeneration.json"
SMOKE_OUT = RESULTS / "regeneration_smoke.json"
BOUND = 1e-4  # |diff| <= BOUND * max(1, |ref|): fp32 agreement


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=None, help="N chat prompts, one generation group (default 8; smoke 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="M new tokens at most per prompt (default 64; smoke 4)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed generations and prefills each; the fastest counts (default 2; smoke 1)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the engine (this process)")
    p.add_argument("--no-stop", action="store_true", help="ignore end-of-turn / eos: every answer gets M tokens")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON result (default {DEFAULT_OUT}; smoke {SMOKE_OUT})")
    args = p.parse_args(argv)
    for name, full, smoke in (("prompts", 8, 2), ("max_new_tokens", 64, 4), ("reps", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.out is None:
        args.out = SMOKE_OUT if args.smoke else DEFAULT_OUT
    return args


# ------------------------------------------------------------------------------------ capture
def _pair(output) -> tuple[torch.Tensor, torch.Tensor]:
    """The text model's output (final, aux) -> (aux [n, 3H], final [n, H]); Llama's aux is a list."""
    final, aux = output
    if isinstance(aux, (list, tuple)):
        aux = torch.cat(list(aux), -1)
    return aux, final


class StepRecorder:
    """A second forward hook on the engine's text module: while `active`, keeps each call's ids,
    positions, extend/decode mode and (aux, final) output (cloned: the capture design would keep them)."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[dict] = []
        self.active = False
        self.hook_s = 0.0  # time spent inside this hook (the capture design's bookkeeping)
        self.handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        if not self.active:
            return
        t0 = time.perf_counter()
        ids = args[0] if len(args) > 0 else kwargs["input_ids"]
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        batch = args[2] if len(args) > 2 else kwargs["forward_batch"]
        aux, final = _pair(output)
        self.calls.append({"decode": bool(batch.forward_mode.is_decode()), "ids": ids.detach().to("cpu").clone(),
                           "positions": positions.detach().to("cpu").clone(),
                           "aux": aux.detach().to("cpu").clone(), "final": final.detach().to("cpu").clone()})
        self.hook_s += time.perf_counter() - t0

    def start(self) -> None:
        self.calls, self.hook_s, self.active = [], 0.0, True

    def stop(self) -> None:
        self.active = False


def assemble(calls: list[dict], prompts: list[torch.Tensor], answers: list[list[int]]):
    """Per conversation: (ids, aux, final) of the positions the generation computed: every prompt token
    (the extend's rows, packed in request order) and each answer token that was fed to a decode step
    (decode step j feeds answer token j of every request still decoding, in request order: a finished
    request has left the batch, so the last token of an answer is never fed). Checks the recorded ids
    and positions against the answers."""
    extend, decodes = calls[0], calls[1:]
    if extend["decode"] or not all(c["decode"] for c in decodes):
        raise RuntimeError(f"expected one extend then decode steps, saw {[c['decode'] for c in calls]}")
    lengths = [len(p) for p in prompts]
    if extend["aux"].shape[0] != sum(lengths):
        raise RuntimeError(f"extend output has {extend['aux'].shape[0]} rows for {sum(lengths)} prompt tokens")
    out = []
    rows = zip(torch.split(extend["ids"], lengths), torch.split(extend["aux"], lengths),
               torch.split(extend["final"], lengths))
    for b, (ids, aux, final) in enumerate(rows):
        if not torch.equal(ids.to(torch.int64), prompts[b].to(torch.int64)):
            raise RuntimeError(f"extend rows of request {b} are not its prompt")
        ids, aux, final = [ids.to(torch.int64)], [aux], [final]
        for j, step in enumerate(decodes):
            if j + 1 >= len(answers[b]):
                break
            r = sum(1 for c in range(b) if len(answers[c]) > j + 1)  # its row: the requests before it still decoding
            if int(step["ids"][r]) != answers[b][j] or int(step["positions"][r]) != lengths[b] + j:
                raise RuntimeError(f"decode step {j} request {b}: fed id {int(step['ids'][r])} at position "
                                   f"{int(step['positions'][r])}, expected {answers[b][j]} at {lengths[b] + j}")
            ids.append(step["ids"][r:r + 1].to(torch.int64))
            aux.append(step["aux"][r:r + 1])
            final.append(step["final"][r:r + 1])
        out.append((torch.cat(ids), torch.cat(aux), torch.cat(final)))
    return out


# ---------------------------------------------------------------------------------- exactness
def ratio(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per element |a - ref| / (BOUND * max(1, |ref|)); <= 1 is fp32 agreement."""
    return (a - ref).abs() / (BOUND * ref.abs().clamp(min=1.0))


def compare(got: list[tuple[torch.Tensor, torch.Tensor]], ref: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """got / ref: per conversation (aux, final) over the same positions."""
    res = {"positions": sum(len(a) for a, _ in got)}
    for k, name in enumerate(("aux", "final")):
        if not res["positions"]:
            res[name], res[f"{name}_max_abs_diff"] = float("nan"), float("nan")
            continue
        a = torch.cat([g[k] for g in got])
        r = torch.cat([x[k] for x in ref])
        res[name] = float(ratio(a, r).max())
        res[f"{name}_max_abs_diff"] = float((a - r).abs().max())
    return res


def decode_capture_exactness(captured, prefill, prompt_lengths: list[int]) -> dict:
    """captured: per conversation (ids, aux, final) from the generation; prefill: per conversation
    (aux, final) of the packed prefill. Overall, prompt rows, answer rows, worst position."""
    overall, prompt_part, answer_part = ([], []), ([], []), ([], [])
    worst = {"ratio": -1.0}
    for c, ((_, aux, final), (p_aux, p_final), n_prompt) in enumerate(zip(captured, prefill, prompt_lengths)):
        n = len(aux)
        pairs = ((aux, p_aux[:n]), (final, p_final[:n]))
        for k, (got, ref) in enumerate(pairs):
            overall[k].append((got, ref))
            prompt_part[k].append((got[:n_prompt], ref[:n_prompt]))
            answer_part[k].append((got[n_prompt:], ref[n_prompt:]))
        per_pos = torch.stack([ratio(got, ref).amax(-1) for got, ref in pairs])  # [2, n]
        t = int(per_pos.amax(0).argmax())
        if float(per_pos[:, t].max()) > worst["ratio"]:
            worst = {"ratio": float(per_pos[:, t].max()), "conversation": c, "position": t,
                     "row": "prompt (extend)" if t < n_prompt else f"answer token {t - n_prompt} (decode)",
                     "aux": float(per_pos[0, t]), "final": float(per_pos[1, t])}

    def part(sides):
        got = [(a, f) for (a, _), (f, _) in zip(*sides)]
        ref = [(a, f) for (_, a), (_, f) in zip(*sides)]
        return compare(got, ref)

    return {"all": part(overall), "prompt_rows": part(prompt_part), "answer_rows": part(answer_part),
            "worst_position": worst}


# ------------------------------------------------------------------------------------ measure
def build(args):
    from transformers import AutoTokenizer

    from specforge_k25.data.tokenize import template_prompt_ids
    from specforge_k25.eval.prompts import load_prompt_set
    from specforge_k25.target_engine.factory import TargetSpec, build_target
    from specforge_k25.target_engine.hf_config import read_target_info
    from specforge_k25.target_engine.layers import default_capture_points
    from specforge_k25.target_engine.models import smollm2_path
    from specforge_k25.target_engine.sampling import Regeneration

    path = str(smollm2_path())
    info = read_target_info(path)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [torch.tensor(p, dtype=torch.int64) for p in load_prompt_set(
        "mtbench", args.prompts, lambda messages: template_prompt_ids(tok, messages))]
    stop = () if args.no_stop else (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    regen = Regeneration(max_new_tokens=args.max_new_tokens, max_length=max(len(p) for p in prompts)
                         + args.max_new_tokens, stop_ids=tuple(stop), group_sequences=args.prompts)
    spec = TargetSpec(engine="sglang", model_path=path, architecture=info.architecture,
                      capture_points=default_capture_points(info.num_layers), num_threads=args.threads)
    t0 = time.perf_counter()
    target = build_target(spec)
    torch.set_num_threads(args.threads)
    start_s = time.perf_counter() - t0
    return target, info, prompts, regen, start_s


def measure(args) -> dict:
    from specforge_k25.target_engine.sglang_engine import _text_model

    target, info, prompts, regen, start_s = build(args)
    budgets = [regen.budget(len(p)) for p in prompts]
    recorder = StepRecorder(_text_model(target.model))
    print(f"engine up in {start_s:.1f} s; {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, "
          f"budget {args.max_new_tokens}", flush=True)

    # warm-up: both kernels' paths once (prefill shapes, one short generation)
    t0 = time.perf_counter()
    target.warmup()
    target.generate(prompts[:1], [2], regen)
    warmup_s = time.perf_counter() - t0

    gen_s, answers, captured, hook_s = [], None, None, []
    for rep in range(args.reps):
        recorder.start()
        t0 = time.perf_counter()
        got = target.generate(prompts, budgets, regen)
        gen_s.append(time.perf_counter() - t0)
        recorder.stop()
        hook_s.append(recorder.hook_s)
        asm = assemble(recorder.calls, prompts, got)
        if answers is None:
            answers, captured, decode_steps = got, asm, len(recorder.calls) - 1
        elif got != answers or any(not (torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]))
                                   for a, b in zip(asm, captured)):
            raise RuntimeError("a repeated greedy generation gave other answers or other states")
        print(f"generate {rep}: {gen_s[-1]:.2f} s", flush=True)
    recorder.handle.remove()
    conversations = [torch.cat([p, torch.tensor(a, dtype=torch.int64)]) for p, a in zip(prompts, answers)]

    prefill_s, outs = [], []
    for rep in range(args.reps + 1):  # at least two: the second is the 'prefill again' check
        t0 = time.perf_counter()
        outs.append(target.forward(conversations))
        prefill_s.append(time.perf_counter() - t0)
        print(f"prefill {rep}: {prefill_s[-1]:.2f} s", flush=True)
    lengths = [len(c) for c in conversations]

    def split(out):
        return list(zip(torch.split(out.aux_hidden, out.lengths), torch.split(out.final_hidden, out.lengths)))

    packed = split(outs[0])
    alone = [split(target.forward([c]))[0] for c in conversations]
    target.close()

    prompt_tokens, answer_tokens = sum(len(p) for p in prompts), sum(len(a) for a in answers)
    gen, pre = min(gen_s), min(prefill_s)
    exact = {
        "prefill_again": compare(split(outs[1]), packed),
        "prefill_alone_vs_packed": compare(alone, packed),
        "decode_capture": decode_capture_exactness(captured, packed, [len(p) for p in prompts]),
    }
    return {
        "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "reps": args.reps,
        "stop_ids": list(regen.stop_ids),
        "prompt_lengths": [len(p) for p in prompts], "answer_lengths": [len(a) for a in answers],
        "prompt_tokens": prompt_tokens, "answer_tokens": answer_tokens, "conversation_tokens": sum(lengths),
        "decode_steps": decode_steps,
        "fed_answer_tokens": sum(len(c[0]) for c in captured) - prompt_tokens,
        "timings": {
            "engine_start_s": start_s, "warmup_s": warmup_s,
            "generate_s": gen_s, "prefill_s": prefill_s, "capture_hook_s": hook_s,
            "generate_best_s": gen, "prefill_best_s": pre,
            "prefill_over_generate": pre / gen,
            # regeneration throughput of the prefill design relative to capturing during decoding
            "prefill_design_speed_vs_capture": gen / (gen + pre),
            "generate_new_tokens_per_s": answer_tokens / gen,
            "generate_all_tokens_per_s": (prompt_tokens + answer_tokens) / gen,
            "prefill_tokens_per_s": sum(lengths) / pre,
            "prefill_ms_per_answer_token": 1e3 * pre / max(answer_tokens, 1),
            "decode_ms_per_step": 1e3 * gen / max(decode_steps, 1),
        },
        "exactness": exact,
        "model": {"target": "smollm2", "architecture": info.architecture, "hidden_size": info.hidden_size,
                  "num_layers": info.num_layers, "capture_layer_ids": target.layer_ids, "dtype": "float32",
                  "device": "cpu", "attention_backend": "torch_native"},
    }


# ------------------------------------------------------------------------------------- report
def report(result: dict) -> None:
    t, e = result["timings"], result["exactness"]
    n, m = result["n_prompts"], result["max_new_tokens"]
    print_table(f"regeneration: generate vs prefill afterwards (N={n}, M={m}, best of {result['reps']})",
                ["quantity", "value"], [
                    ["prompt / answer / conversation tokens",
                     f"{result['prompt_tokens']} / {result['answer_tokens']} / {result['conversation_tokens']}"],
                    ["decode steps", result["decode_steps"]],
                    ["generate s (extend + decode steps)", f"{t['generate_best_s']:.3f}"],
                    ["prefill s (prompt + answer, one packed batch)", f"{t['prefill_best_s']:.3f}"],
                    ["prefill / generate", f"{t['prefill_over_generate']:.3f}"],
                    ["prefill design speed / capture design speed", f"{t['prefill_design_speed_vs_capture']:.3f}"],
                    ["generate new tokens/s", f"{t['generate_new_tokens_per_s']:.1f}"],
                    ["generate (prompt + new) tokens/s", f"{t['generate_all_tokens_per_s']:.1f}"],
                    ["prefill tokens/s", f"{t['prefill_tokens_per_s']:.1f}"],
                    ["decode ms/step", f"{t['decode_ms_per_step']:.1f}"],
                    ["capture hook s (in generate)", f"{min(t['capture_hook_s']):.4f}"],
                ])
    d = e["decode_capture"]

    def row(name, r):
        return [name, r["positions"], f"{r['aux']:.3g}", f"{r['final']:.3g}",
                f"{r['aux_max_abs_diff']:.3g}", f"{r['final_max_abs_diff']:.3g}"]

    w = d["worst_position"]
    print_table("exactness vs the packed prefill: max |diff| / (1e-4 * max(1, |prefill|)), <= 1 is fp32 agreement",
                ["comparison", "positions", "aux", "final", "aux max|diff|", "final max|diff|"], [
                    row("prefill again (same batch)", e["prefill_again"]),
                    row("prefill alone vs packed", e["prefill_alone_vs_packed"]),
                    row("decode capture: all", d["all"]),
                    row("decode capture: prompt rows (extend)", d["prompt_rows"]),
                    row("decode capture: answer rows (decode)", d["answer_rows"]),
                    [f"worst position: conv {w['conversation']} pos {w['position']}, {w['row']}", 1,
                     f"{w['aux']:.3g}", f"{w['final']:.3g}", "", ""],
                ])


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    t0 = time.perf_counter()
    result = {"benchmark": "regeneration", **measure(args)}
    report(result)
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["machine"] = machine_info(engine_threads=args.threads)
    result["total_wall_s"] = time.perf_counter() - t0
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
