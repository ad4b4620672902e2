"""The evaluation: greedy outputs, SGLang's acceptance length per head and chain, baselines,
and our own replay of each head on the same outputs.

    prompts -> SGLang greedy (no speculation) -> reference outputs
            -> prompt lookup replayed on the reference outputs -> n-gram AL
            -> target hidden states of prompt+output (the training stream) -> our draft's proposals
               (`DraftMethod.proposals`) -> replayed AL, acc_k and τ_sim on the same prompts
               -> eval.json written (a head without SGLang serving ends here)
            -> SGLang speculative decoding, per head x serving (the head's draft method reads
               eval.chains into its servings and engine arguments, `DraftMethod.servings`)
               -> AL = Σ completion / Σ verify steps (+ same output?) -> eval.json again

Heads: the trained one (`export_dir`, of whichever method wrote it), any further exports
(`eval.heads`), and an untrained head of the run's own method (the `draft` group), built as a
training run starts it. The engines run with the training stream's target settings
(setup/target.py `target_spec`: the same KV pool, memory fraction, threads, attention backend).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from ..config import EvalJobConfig
from ..draft.method import DraftMethod
from ..draft.registry import method_of_export
from ..export.serving import export_draft, load_exported_draft
from ..setup.run import RunSetup, fresh_draft, prepare, prompt_renderer
from ..setup.target import make_target_stream, target_spec
from ..target_engine.hf_config import load_embedding_and_head
from ..target_engine.sglang_spec import engine_kwargs, generate
from .acceptance import draft_proposer, prompt_lookup_proposer, replay, step_counts, tau_sim
from .prompts import load_prompt_set

BASELINES = ("nospec", "ngram")
def aux_columns(head_points: list[int] | None, run_points: list[int], hidden: int) -> torch.Tensor | None:
    """Columns of the stream's aux [T, K*Ht] (the run's capture points) holding a head's capture
    points, in the head's order; None where the run does not capture them all."""
    if head_points is None or head_points == list(run_points):
        return torch.arange(len(run_points) * hidden)
    if not set(head_points) <= set(run_points):
        return None
    return torch.cat([torch.arange(hidden) + list(run_points).index(p) * hidden for p in head_points])


@dataclass
class Cell:
    """One method x chain x prompt set."""

    completion_tokens: int = 0
    verify_steps: int = 0
    replay_tokens: int = 0
    replay_steps: int = 0
    correct: list = field(default_factory=list)
    scored: list = field(default_factory=list)
    mismatched_outputs: int | None = None  # speculative output != greedy reference (prompts)

    def as_dict(self) -> dict:
        out = {}
        if self.verify_steps:
            out["al_sglang"] = self.completion_tokens / self.verify_steps
            out["completion_tokens"], out["verify_steps"] = self.completion_tokens, self.verify_steps
        if self.replay_steps:
            out["al_replay"] = self.replay_tokens / self.replay_steps
        if self.scored:
            out["tau_sim"] = tau_sim(self.correct, self.scored)
            out["acc"] = [c / max(s, 1) for c, s in zip(self.correct, self.scored)]
        if self.mismatched_outputs is not None:
            out["outputs_differ_from_greedy"] = self.mismatched_outputs
        return out


def _heads(job: EvalJobConfig, setup: RunSetup, out_dir: Path) -> dict[str, Path]:
    """Row name -> exported head folder: `trained` (export_dir), the `eval.heads` exports, and
    `untrained`, a fresh head of the run's method exported here."""
    heads = {}
    wanted = set(job.eval.methods)
    trained = Path(job.export_dir) if job.export_dir else None
    if "trained" in wanted and trained is None:
        print("eval: export_dir is unset, so there is no trained head row (pass export_dir=<train run>/export)")
    elif "trained" in wanted:
        heads["trained"] = trained
    for name, path in (job.eval.heads or {}).items():
        if name in (*BASELINES, "trained", "untrained"):
            raise ValueError(f"eval.heads.{name}: the row name {name!r} is taken; pick another")
        heads[str(name)] = Path(path)
    for name, path in heads.items():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{name} head {path}: no config.json (expected a `train` run's export/ folder)")
        method_of_export(path)  # an export of no draft method fails here, before any engine starts
    if "untrained" in wanted:
        draft, _ = fresh_draft(setup, job.draft, job.eval.untrained_seed)  # as a training run of this config starts
        bos, eos = setup.tokenizer.bos_token_id, setup.tokenizer.eos_token_id
        heads["untrained"] = export_draft(draft, out_dir / "untrained_head", setup.sglang_capture_ids, bos, eos,
                                          capture_points=setup.capture_points, end_of_turn_id=setup.end_of_turn_id)
    return heads


def _target_hidden(job: EvalJobConfig, setup: RunSetup, sequences: list[list[int]]):
    """Yields (index, aux [T, K*Ht], final [T, Ht]) for each sequence, from the same target process training uses."""
    samples = [SimpleNamespace(input_ids=torch.tensor(s)) for s in sequences]
    stream = make_target_stream(job, setup, samples, [[i] for i in range(len(samples))])
    with stream:
        for index, (msg, aux, final) in enumerate(stream):
            yield index, aux.float().clone(), final.float().clone()
            stream.release(msg)


def run_eval(job: EvalJobConfig, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ev = job.eval
    # the eval's own stream replays fixed prompt + output ids: the target must not answer them anew
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, regenerate=False, regen_source=None))
    setup = prepare(job)
    heads = _heads(job, setup, out_dir)
    render_prompt = prompt_renderer(job.target, setup.tokenizer)
    sets = {name: load_prompt_set(name, ev.num_prompts, render_prompt, setup.data.heldout) for name in ev.prompt_sets}
    prompts = [p for name in sets for p in sets[name]]
    owner = [name for name in sets for _ in sets[name]]
    engine = dict(engine_kwargs(target_spec(job, tokenizer=setup.tokenizer)), max_new_tokens=ev.max_new_tokens,
                  max_running_requests=ev.max_running_requests, draft_attention_backend=ev.draft_attention_backend)
    methods = {head: method_of_export(path) for head, path in heads.items()}
    served = {head: methods[head].servings(ev.chains) for head in heads}  # each method's reading of eval.chains
    sglang_heads = [head for head in heads if methods[head].serves_sglang]  # the others: replay only
    # the n-gram baseline at every chain and at every other serving a head gets (a block of B: B-1 tokens)
    ngram_at = {c.label: c.draft_tokens for c in DraftMethod().servings(ev.chains)}
    for head in heads:
        ngram_at.update((c.label, c.draft_tokens) for c in served[head] if c.label not in ngram_at)
    at = ", ".join(f"{h} at {[c.label for c in served[h]]}" for h in heads)
    print(f"eval: {len(prompts)} prompts ({', '.join(f'{k} {len(v)}' for k, v in sets.items())}), "
          f"{ev.max_new_tokens} new tokens each; heads {at or 'none'}; "
          f"{1 + sum(len(served[h]) for h in sglang_heads)} SGLang engine runs (greedy first, speculative after the "
          f"replay), one target pass for the replay", flush=True)

    cells: dict[tuple[str, str, str], Cell] = {}
    verify_steps: dict[str, dict[str, list[int]]] = {}  # "head chain" -> {"sglang": [...], "replay": [...]} per prompt

    def add(method: str, label: str, name: str, **counts) -> None:
        """Adds counts to the prompt set's cell and to the 'all' cell."""
        for key in (name, "all"):
            c = cells.setdefault((method, label, key), Cell())
            for attr, value in counts.items():
                old = getattr(c, attr)
                if isinstance(value, list):
                    setattr(c, attr, [a + b for a, b in zip(old, value)] if old else list(value))
                else:
                    setattr(c, attr, (old or 0) + value)

    greedy = generate(setup.model_path, prompts, **engine)
    timings = {"nospec": {"start_s": greedy.start_s, "generate_s": greedy.generate_s,
                          "tokens_per_s": sum(greedy.completion_tokens) / greedy.generate_s}}
    sequences = [p + o for p, o in zip(prompts, greedy.outputs)]
    for i, name in enumerate(owner):  # one target step per token: AL 1.0 by definition
        add("nospec", "-", name, completion_tokens=greedy.completion_tokens[i], verify_steps=greedy.completion_tokens[i])
    for label, draft_tokens in ngram_at.items():
        for i, name in enumerate(owner):
            n, steps = replay(sequences[i], len(prompts[i]),
                              prompt_lookup_proposer(sequences[i], draft_tokens - 1, ev.ngram_max, ev.ngram_min))
            add("ngram", label, name, replay_tokens=n, replay_steps=steps)

    if heads:
        embed, lm_head = load_embedding_and_head(setup.model_path)
        drafts = {head: load_exported_draft(path, embed, lm_head).eval() for head, path in heads.items()}
        columns = {head: aux_columns(methods[head].export_capture_points(heads[head]), setup.capture_points,
                                     embed.shape[1]) for head in drafts}
        for head in [h for h, c in columns.items() if c is None]:
            print(f"eval: the {head} head reads layers the run does not capture ({setup.capture_points}); "
                  f"SGLang's AL only")
            del drafts[head]
        print("eval: target hidden states of prompt + greedy output, our heads replayed on them", flush=True)
        for i, aux, final in tqdm(_target_hidden(job, setup, sequences), total=len(sequences), desc="replay",
                            unit="prompt", disable=not job.train.progress):
            ids = torch.tensor(sequences[i])
            for head, draft in list(drafts.items()):
                proposals = methods[head].proposals(draft, aux[:, columns[head]], ids, served[head], final)
                if proposals is None:
                    print(f"eval: the {head} head ({methods[head].name}) has no proposals to replay; SGLang's AL only")
                    del drafts[head]
                    continue
                for serving, predictions in zip(served[head], proposals):
                    n, steps = replay(sequences[i], len(prompts[i]), draft_proposer(predictions))
                    verify_steps.setdefault(f"{head} {serving.label}", {}).setdefault("replay", []).append(steps)
                    correct, scored = step_counts(predictions, sequences[i], len(prompts[i]))
                    add(head, serving.label, owner[i], replay_tokens=n, replay_steps=steps, correct=correct, scored=scored)

    def write() -> dict:
        """eval.json as far as the eval has come (after the replay: before any speculative engine starts)."""
        results = {
            "target": setup.model_path, "export_dir": job.export_dir, "prompt_sets": {k: len(v) for k, v in sets.items()},
            "heads": {head: {"path": str(path), "method": methods[head].name} for head, path in heads.items()},
            "max_new_tokens": ev.max_new_tokens, "chains": list(ngram_at), "timings": timings,
            "servings": {head: [{"setting": c.label, "sglang": c.sglang_args,
                                 "vllm_speculative_config": c.vllm_speculative_config}
                                for c in served[head]] for head in heads},
            "verify_steps_per_prompt": verify_steps,
            "rows": [{"method": m, "chain": ch, "prompt_set": s, **c.as_dict()} for (m, ch, s), c in cells.items()],
        }
        (out_dir / "eval.json").write_text(json.dumps(results, indent=1))
        return results

    write()
    for head in heads:
        if head not in sglang_heads:
            print(f"eval: the {head} head ({methods[head].name}) has no SGLang serving: replay only", flush=True)
    for head in sglang_heads:
        path = heads[head]
        for serving in served[head]:
            draft_args = serving.sglang_args
            print(f"eval: SGLang {draft_args['speculative_algorithm']} with the {head} head ({methods[head].name}), "
                  f"{serving.label}", flush=True)
            spec = generate(setup.model_path, prompts, draft_path=str(path), draft_args=draft_args, **engine)
            timings[f"{head} {serving.label}"] = {"start_s": spec.start_s, "generate_s": spec.generate_s,
                                                  "tokens_per_s": sum(spec.completion_tokens) / spec.generate_s}
            verify_steps.setdefault(f"{head} {serving.label}", {})["sglang"] = spec.verify_steps
            for i, name in enumerate(owner):
                add(head, serving.label, name, completion_tokens=spec.completion_tokens[i], verify_steps=spec.verify_steps[i],
                    mismatched_outputs=int(spec.outputs[i] != greedy.outputs[i]))

    return write()
