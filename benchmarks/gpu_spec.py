"""d) and e) of the GPU check (benchmarks/gpu_e2e.py): heads of every draft method served by SGLang.

d) EAGLE-3 (the head b) trained when b ran in the same command, else an untrained one), chain 3/1/4,
   CUDA graphs off and on; e) DFlash (block 4) and MLA EAGLE-3 (chain 3/1/4), graphs off. The DFlash
   head is fitted to accept (`fit_dflash`, as tests/eval/test_eval_dflash.py builds its head): one
   layer, no MLP, o_proj solved by ridge regression so that block position j at every root r of the
   greedy outputs lands on x[r+j]; it memorises them through attention over the context's target
   states, so a server that reads other layers or attends otherwise proposes otherwise. The MLA
   head is untrained: on a random target it accepts next to nothing, and its check is the decoding.
For each head, against the same target (fp32, greedy):
  * SGLang's speculative output == SGLang's greedy output, prompt by prompt;
  * SGLang's verify steps == our replay of the same head (eval/acceptance.py, the method's
    `proposals` on HF transformers' hidden states of prompt + output), prompt by prompt (one prompt
    may differ by one step: fp32 near-ties), as tests/eval does on CPU.
One greedy engine (graphs off) serves as the reference of every head; with graphs on the greedy
engine runs only when the speculative output differs from it (it then decides which mode changed the
output). Every engine has a timeout from the caller's deadline; what has no time left is a SKIP row.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from specforge_k25.draft.registry import get_method
from specforge_k25.eval.acceptance import draft_proposer, replay
from specforge_k25.export.serving import export_draft, load_exported_draft
from specforge_k25.target_engine.hf_config import load_embedding_and_head
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.sglang_spec import generate

CHAIN = [[3, 1, 4]]  # EAGLE-3: 3 steps, topk 1, 4 draft tokens; DFlash reads it as block 4
MIN_ENGINE_S = 25.0  # an engine given less than this is skipped, not started
MIN_FITTED_AL = 2.0  # the fitted DFlash head's drafts must be accepted (block 4: at most 4)


def method_spec(name: str, size: dict):
    """draft.* of each method for the check's target (sizes follow the target where unset)."""
    spec = get_method(name).spec_class()
    if name == "dflash":
        spec.block_size, spec.num_layers, spec.num_anchors = CHAIN[0][2], 1, 16
        spec.mask_token_id = 0  # "t0", the unknown word: the random data is ids 3..V-1
        # o_proj's input (heads x head_dim) wider than the rows fit_dflash solves for (~3 per output token)
        spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim = (4, 2, 64) if size["new_tokens"] < 32 else (8, 2, 128)
    else:
        spec.vocab_size, spec.ttt_length = size["draft_vocab"], size["ttt"]
    return spec


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (12, 20, 31, 24)]


def hf_hidden(model_path: str, points: list[int], sequences: list[list[int]], device: str):
    """[(aux [T, K*Ht], final [T, Ht])] per sequence, fp32 on the CPU, from HF transformers."""
    hf = HFTarget(model_path, points, torch.float32)
    hf.model.to(device)
    out = hf.forward([torch.tensor(s, device=device) for s in sequences])
    aux, final = out.aux_hidden.float().cpu(), out.final_hidden.float().cpu()
    del hf, out
    rows, at = [], 0
    for s in sequences:
        rows.append((aux[at:at + len(s)], final[at:at + len(s)]))
        at += len(s)
    return rows


def replay_steps(method, export: Path, model_path: str, hidden, sequences, prompt_lens, serving) -> list[int]:
    """Our replay of the exported head (loaded as eval/run.py loads one) on the same outputs."""
    embed, lm_head = load_embedding_and_head(model_path)
    draft = load_exported_draft(export, embed.float(), lm_head.float()).eval()
    steps = []
    with torch.no_grad():
        for (aux, final), seq, n in zip(hidden, sequences, prompt_lens):
            (pred,) = method.proposals(draft, aux, torch.tensor(seq), [serving], final)
            steps.append(replay(seq, n, draft_proposer(pred))[1])
    return steps


def fit_dflash(draft, method, serving, prompts, sequences, hidden, ridge: float = 1e-2) -> None:
    """In place, on the CPU: draft's MLP off and its o_proj fitted (float64 ridge regression) so that
    every root's block proposes the greedy output (see the module docstring)."""
    cfg, B = draft.cfg, serving.draft_tokens
    embed = draft.embed_tokens.weight.detach().float()
    unit = torch.nn.functional.normalize(embed, dim=-1)
    layer = draft.layers[0]
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()  # the block's hidden = its embedding + o_proj(attention)
    seen, rows, targets = [], [], []
    hook = layer.self_attn.o_proj.register_forward_hook(
        lambda m, i, o: seen.append(i[0].detach().reshape(-1, i[0].shape[-1])))
    try:
        with torch.no_grad():
            for prompt, seq, (aux, final) in zip(prompts, sequences, hidden):
                seen.clear()
                method.proposals(draft, aux, torch.tensor(seq), [serving], final)
                per_root = torch.cat(seen).view(len(seq) - 1, B, -1)  # roots 1..T-1
                for r in range(len(prompt), len(seq) - 1):
                    for j in range(1, min(B, len(seq) - r)):
                        rows.append(per_root[r - 1, j])
                        targets.append(30 * unit[seq[r + j]] - embed[cfg.mask_token_id])
    finally:
        hook.remove()
    a, y = torch.stack(rows).double(), torch.stack(targets).double()
    w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=torch.float64), a.T @ y).T
    with torch.no_grad():
        layer.self_attn.o_proj.weight.copy_(w.float())


def steps_agree(sglang: list[int] | None, ours: list[int] | None) -> bool:
    """Prompt by prompt; one prompt may differ by one step (fp32 near-ties in the draft's argmax)."""
    if not sglang or not ours or len(sglang) != len(ours):
        return False
    differ = [abs(a - b) for a, b in zip(sglang, ours) if a != b]
    return len(differ) <= 1 and max(differ, default=0) <= 1


class Engines:
    """generate() with a timeout from the deadline; records each engine's wall time."""

    def __init__(self, args, size: dict, deadline: float | None, engine_timeout: float):
        self.args, self.deadline, self.engine_timeout = args, deadline, engine_timeout
        cuda = args.device == "cuda"
        self.kw = dict(max_new_tokens=size["new_tokens"], device=args.device, dtype="float32",
                       num_threads=args.threads, max_total_tokens=4096,
                       mem_fraction_static=0.05 if cuda else 0.15)
        if cuda:  # the draft worker on the target's backend (apply_gpu's default), stated, not inferred
            self.kw["draft_attention_backend"] = "triton"

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def run(self, model_path, prompts, graphs, **draft):
        timeout = min(self.engine_timeout, self.left() - 5)
        if timeout < MIN_ENGINE_S:
            raise TimeoutError(f"skipped: {max(self.left(), 0):.0f} s left before the deadline")
        kw = dict(self.kw, cuda_graph=graphs if self.args.device == "cuda" else None, timeout_s=timeout)
        if self.args.device != "cuda":
            kw.pop("draft_attention_backend", None)
        return generate(model_path, prompts, **kw, **draft)


def serve(args, heads: dict, export_root: Path, size: dict, modes: dict, deadline: float | None = None,
          engine_timeout: float = 150.0, on_row=None) -> tuple[list[dict], dict]:
    """heads: {label: (setup, draft)}; modes: {label: [graphs, ...]} (graphs False first).
    -> (rows, tracebacks). Each row is handed to `on_row` as soon as it exists."""
    engines = Engines(args, size, deadline, engine_timeout)
    first = next(iter(heads.values()))[0]
    model_path, info = first.model_path, first.info
    prompts = prompts_for(info.vocab_size, args.seed)
    prompt_lens = [len(p) for p in prompts]
    rows, errors, greedy, hidden = [], {}, {}, {}
    device = "cuda" if args.device == "cuda" else "cpu"

    def emit(row):
        rows.append(row)
        if on_row:
            on_row(row)

    def states(setup, sequences):  # HF's hidden states of prompt + output, per capture points
        key = (str(sequences), tuple(setup.capture_points))
        if key not in hidden:
            hidden[key] = hf_hidden(model_path, setup.capture_points, sequences, device)
        return hidden[key]

    for label, (setup, draft) in heads.items():
        method = setup.method
        serving = method.servings(CHAIN)[0]
        for graphs in modes[label]:
            t0 = time.perf_counter()
            row = {"head": label, "method": method.name, "serving": serving.label, "cuda_graph": graphs,
                   "prompts": len(prompts)}
            try:
                if False not in greedy:
                    greedy[False] = engines.run(model_path, prompts, False)
                sequences = [p + o for p, o in zip(prompts, greedy[False].outputs)]
                export = export_root / label
                if not export.is_dir():
                    export = export_draft(draft, export, setup.sglang_capture_ids, info.bos_token_id,
                                          info.eos_token_id, capture_points=setup.capture_points)
                    if method.name == "dflash":  # refitted on the CPU copy SGLang will load, then exported again
                        embed, lm_head = load_embedding_and_head(model_path)
                        fitted = load_exported_draft(export, embed.float(), lm_head.float()).eval()
                        fit_dflash(fitted, method, serving, prompts, sequences, states(setup, sequences))
                        export = export_draft(fitted, export, setup.sglang_capture_ids, info.bos_token_id,
                                              info.eos_token_id, capture_points=setup.capture_points)
                    row["fitted"] = method.name == "dflash"
                spec = engines.run(model_path, prompts, graphs, draft_path=str(export), draft_args=serving.sglang_args)
                ref = greedy[False]
                if graphs and spec.outputs != ref.outputs:  # which mode changed the output: the graphs' greedy
                    greedy[True] = ref = engines.run(model_path, prompts, True)
                same = [a == b for a, b in zip(ref.outputs, spec.outputs)]
                sequences = [p + o for p, o in zip(prompts, ref.outputs)]
                ours = replay_steps(method, export, model_path, states(setup, sequences), sequences, prompt_lens,
                                    serving)
                tokens, steps = sum(spec.completion_tokens), sum(spec.verify_steps or [])
                row.update(identical=sum(same), completion_tokens=tokens, verify_steps=spec.verify_steps,
                           replay_steps=ours, accept_length=tokens / steps if steps else None,
                           replay_accept_length=tokens / sum(ours) if sum(ours) else None,
                           reference="greedy graphs on" if ref is greedy.get(True) else "greedy graphs off",
                           engine_start_s=spec.start_s, generate_s=spec.generate_s,
                           ok=all(same) and tokens > 0 and steps_agree(spec.verify_steps, ours))
                if row.get("fitted"):  # the comparison is not vacuous only if drafts were accepted
                    row["ok"] = row["ok"] and (row["accept_length"] or 0) >= MIN_FITTED_AL
            except TimeoutError as err:
                row.update(ok=None, skipped=str(err))
            except Exception as err:  # noqa: BLE001 - the other heads and modes still run
                row.update(ok=False, error=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}")
                errors[f"{label} graphs {'on' if graphs else 'off'}"] = traceback.format_exc()[-6000:]
            row["wall_s"] = time.perf_counter() - t0
            emit(row)
    return rows, errors


NAMES = {"eagle3": "EAGLE-3", "eagle3_mla": "MLA EAGLE-3", "dflash": "DFlash"}


def describe(row: dict, check: str) -> tuple[str, str]:
    """(status, text) of one row."""
    mode = (f"{check}) {NAMES.get(row['method'], row['method'])} {row['serving']} in SGLang, CUDA graphs {'on' if row['cuda_graph'] else 'off'}")
    if "skipped" in row:
        return "SKIP", f"{mode}: {row['skipped']}"
    if "error" in row:
        return "FAIL", f"{mode} raised {row['error']} ({row['wall_s']:.0f} s)"
    return ("PASS" if row["ok"] else "FAIL"), (
        f"{mode}: speculative == greedy for {row['identical']}/{row['prompts']} prompts ({row['completion_tokens']} "
        f"tokens, accept length {row['accept_length'] or 0:.2f}, replay {row['replay_accept_length'] or 0:.2f}; "
        f"verify steps {row['verify_steps']} vs replay {row['replay_steps']}; {row['wall_s']:.0f} s)")
