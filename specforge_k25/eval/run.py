"""The evaluation: greedy outputs, SGLang's acceptance length per head and chain, baselines,
and our own replay of each head on the same outputs.

    prompts -> SGLang greedy (no speculation) -> reference outputs
            -> SGLang speculative decoding, per head x chain (the head's draft method gives the
               engine arguments) -> AL = Σ completion / Σ verify steps (+ same output?)
            -> prompt lookup replayed on the reference outputs -> n-gram AL
            -> target hidden states of prompt+output (the training stream) -> our draft's proposals
               -> replayed AL, acc_k and τ_sim on the same prompts

Heads: the trained one (`export_dir`, of whichever method wrote it), any further exports
(`eval.heads`), and an untrained head of the run's own method (`draft.method`), built as a
training run starts it. The engines run with the training stream's target settings
(setup/run.py `target_spec`: the same KV pool, memory fraction, threads, attention backend).
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
from ..draft.registry import method_of_export
from ..export.serving import export_draft, load_exported_draft
from ..setup.run import RunSetup, fresh_draft, make_target_stream, prepare, prompt_renderer, target_spec
from ..target_engine.hf_config import load_embedding_and_head
from ..target_engine.sglang_spec import Block, Chain, engine_kwargs, generate
from .acceptance import (block_predictions, can_replay, can_replay_blocks, draft_predictions, draft_proposer,
                         prompt_lookup_proposer, replay, step_counts, tau_sim)
from .prompts import load_prompt_set

BASELINES = ("nospec", "ngram")
BLOCK_ALGORITHMS = ("DFLASH",)  # SGLang algorithms that draft a block per step (served at eval.dflash_blocks)


def settings(method, chains: list[Chain], blocks: list[Block]) -> list:
    """The speculative settings a head of `method` is served at: blocks for a block drafter, else chains."""
    return blocks if method.sglang_algorithm in BLOCK_ALGORITHMS else chains


def head_predictions(draft, aux: torch.Tensor, ids: torch.Tensor, served: list) -> list[torch.Tensor]:
    """Per setting in `served`, [steps, T] proposals of `draft` at every root (acceptance.py layout).
    A block drafter runs once per block size (its blocks attend in both directions, so a longer
    block changes the earlier proposals); a chain once, as deep as the deepest chain."""
    if can_replay_blocks(draft):
        return [block_predictions(draft, aux, ids, block.size) for block in served]
    deepest = draft_predictions(draft, aux, ids, max(chain.steps for chain in served))
    return [deepest[: chain.steps] for chain in served]


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
        draft, _ = fresh_draft(setup, job.eval.untrained_seed)  # as a training run of this config starts
        bos, eos = setup.tokenizer.bos_token_id, setup.tokenizer.eos_token_id
        heads["untrained"] = export_draft(draft, out_dir / "untrained_head", setup.eagle_layer_ids, bos, eos,
                                          capture_points=setup.capture_points, end_of_turn_id=setup.end_of_turn_id)
    return heads


def _capture_points(export: Path) -> list[int] | None:
    """The capture points a head reads: its config's top-level vLLM ids (= capture points, every method)."""
    ids = json.loads((export / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def _target_hidden(job: EvalJobConfig, setup: RunSetup, sequences: list[list[int]]):
    """Yields (index, aux [T, K*Ht]) for each sequence, from the same target process training uses."""
    samples = [SimpleNamespace(input_ids=torch.tensor(s)) for s in sequences]
    stream = make_target_stream(job, setup, samples, [[i] for i in range(len(samples))])
    with stream:
        for index, (msg, aux, _final) in enumerate(stream):
            yield index, aux.float().clone()
            stream.release(msg)


def run_eval(job: EvalJobConfig, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ev = job.eval
    chains, blocks = [Chain(*c) for c in ev.chains], [Block(int(b)) for b in ev.dflash_blocks]
    # the eval's own stream replays fixed prompt + output ids: the target must not answer them anew
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, regenerate=False))
    setup = prepare(job)
    heads = _heads(job, setup, out_dir)
    render_prompt = prompt_renderer(job, setup.tokenizer)
    sets = {name: load_prompt_set(name, ev.num_prompts, render_prompt, setup.data.heldout) for name in ev.prompt_sets}
    prompts = [p for name in sets for p in sets[name]]
    owner = [name for name in sets for _ in sets[name]]
    engine = dict(engine_kwargs(target_spec(job, tokenizer=setup.tokenizer)), max_new_tokens=ev.max_new_tokens,
                  max_running_requests=ev.max_running_requests, draft_attention_backend=ev.draft_attention_backend)
    methods = {head: method_of_export(path) for head, path in heads.items()}
    served = {head: settings(methods[head], chains, blocks) for head in heads}
    baseline_settings = chains + (blocks if any(s is blocks for s in served.values()) else [])
    at = ", ".join(f"{h} at {[c.label() for c in served[h]]}" for h in heads)
    print(f"eval: {len(prompts)} prompts ({', '.join(f'{k} {len(v)}' for k, v in sets.items())}), "
          f"{ev.max_new_tokens} new tokens each; heads {at or 'none'}; "
          f"{1 + sum(map(len, served.values()))} SGLang engine runs, then one target pass for the replay", flush=True)

    cells: dict[tuple[str, str, str], Cell] = {}
    verify_steps: dict[str, dict[str, list[int]]] = {}  # "head chain" -> {"sglang": [...], "replay": [...]} per prompt

    def add(method: str, chain: Chain | Block | None, name: str, **counts) -> None:
        """Adds counts to the prompt set's cell and to the 'all' cell."""
        for key in (name, "all"):
            c = cells.setdefault((method, chain.label() if chain else "-", key), Cell())
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
        add("nospec", None, name, completion_tokens=greedy.completion_tokens[i], verify_steps=greedy.completion_tokens[i])
    for chain in baseline_settings:
        for i, name in enumerate(owner):
            n, steps = replay(sequences[i], len(prompts[i]),
                              prompt_lookup_proposer(sequences[i], chain.draft_tokens - 1, ev.ngram_max, ev.ngram_min))
            add("ngram", chain, name, replay_tokens=n, replay_steps=steps)

    if heads:
        embed, lm_head = load_embedding_and_head(setup.model_path)
        drafts = {head: load_exported_draft(path, embed, lm_head).eval() for head, path in heads.items()}
        for head in [h for h, d in drafts.items() if not (can_replay(d) or can_replay_blocks(d))]:
            print(f"eval: the {head} head ({methods[head].name}) has no proposals to replay; SGLang's AL only")
            del drafts[head]
        columns = {head: aux_columns(_capture_points(heads[head]), setup.capture_points, embed.shape[1])
                   for head in drafts}
        for head in [h for h, c in columns.items() if c is None]:
            print(f"eval: the {head} head reads layers the run does not capture ({setup.capture_points}); "
                  f"SGLang's AL only")
            del drafts[head]
        print("eval: target hidden states of prompt + greedy output, our heads replayed on them", flush=True)
        for i, aux in tqdm(_target_hidden(job, setup, sequences), total=len(sequences), desc="replay",
                            unit="prompt", disable=not job.train.progress):
            ids = torch.tensor(sequences[i])
            for head, draft in drafts.items():
                for chain, predictions in zip(served[head], head_predictions(draft, aux[:, columns[head]], ids,
                                                                             served[head])):
                    n, steps = replay(sequences[i], len(prompts[i]), draft_proposer(predictions))
                    verify_steps.setdefault(f"{head} {chain.label()}", {}).setdefault("replay", []).append(steps)
                    correct, scored = step_counts(predictions, sequences[i], len(prompts[i]))
                    add(head, chain, owner[i], replay_tokens=n, replay_steps=steps, correct=correct, scored=scored)

    for head, path in heads.items():
        for chain in served[head]:
            draft_args = chain.draft_args(methods[head])
            print(f"eval: SGLang {draft_args['speculative_algorithm']} with the {head} head ({methods[head].name}), "
                  f"{chain.label()}", flush=True)
            spec = generate(setup.model_path, prompts, draft_path=str(path), draft_args=draft_args, **engine)
            timings[f"{head} {chain.label()}"] = {"start_s": spec.start_s, "generate_s": spec.generate_s,
                                                  "tokens_per_s": sum(spec.completion_tokens) / spec.generate_s}
            verify_steps.setdefault(f"{head} {chain.label()}", {})["sglang"] = spec.verify_steps
            for i, name in enumerate(owner):
                add(head, chain, name, completion_tokens=spec.completion_tokens[i], verify_steps=spec.verify_steps[i],
                    mismatched_outputs=int(spec.outputs[i] != greedy.outputs[i]))

    results = {
        "target": setup.model_path, "export_dir": job.export_dir, "prompt_sets": {k: len(v) for k, v in sets.items()},
        "heads": {head: {"path": str(path), "method": methods[head].name} for head, path in heads.items()},
        "max_new_tokens": ev.max_new_tokens, "chains": [c.label() for c in baseline_settings], "timings": timings,
        "verify_steps_per_prompt": verify_steps,
        "rows": [{"method": m, "chain": ch, "prompt_set": s, **c.as_dict()} for (m, ch, s), c in cells.items()],
    }
    (out_dir / "eval.json").write_text(json.dumps(results, indent=1))
    return results
