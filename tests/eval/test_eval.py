"""`python -m specforge_k25.eval` end to end on CPU with SGLang's own EAGLE-3 decoding, and
SGLang's draft model against ours on the same inputs.

A head with some acceptance is built without training: its one decoder layer is a copy of
SmolLM2's layer 27 reading the captured input of that layer (the third aux state), its head is
the target's (tied) embedding over the full vocabulary. It predicts roughly what the target
predicts one position earlier, so it is right mainly where the output repeats itself: a weak
head, but one whose accepted drafts make the SGLang-vs-replay comparison non-trivial.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge_k25.draft.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import draft_to_target
from specforge_k25.export.serving import export_draft, load_exported_draft
from specforge_k25.target_engine.hf_config import load_embedding_and_head

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_EAGLE_IDS = [1, 14, 26]  # capture points [2, 15, 27] (tests/target_engine/test_target.py checks the rule)
SMOLLM2_POINTS = [2, 15, 27]


def layer_copy_head(target: str, out_dir: Path, layer: int = 27) -> Path:
    weights = load_file(Path(target, "model.safetensors"))
    cfg_json = json.loads(Path(target, "config.json").read_text())
    H, V = cfg_json["hidden_size"], cfg_json["vocab_size"]
    cfg = DraftConfig(hidden_size=H, intermediate_size=cfg_json["intermediate_size"],
                      num_attention_heads=cfg_json["num_attention_heads"],
                      num_key_value_heads=cfg_json["num_key_value_heads"], head_dim=H // cfg_json["num_attention_heads"],
                      vocab_size=V, draft_vocab_size=V, target_hidden_size=H, rms_norm_eps=cfg_json["rms_norm_eps"],
                      rope_theta=cfg_json.get("rope_theta") or cfg_json["rope_parameters"]["rope_theta"],
                      max_position_embeddings=cfg_json["max_position_embeddings"])
    draft = Eagle3Draft(cfg)
    src = f"model.layers.{layer}."
    zeros = lambda w: torch.zeros(w.shape[0], H)  # noqa: E731  (the embedding half of q/k/v is ignored)
    state = {
        "fc.weight": torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1),  # keep the third aux state
        "midlayer.hidden_norm.weight": weights[src + "input_layernorm.weight"],
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": weights[src + "post_attention_layernorm.weight"],
        "midlayer.self_attn.o_proj.weight": weights[src + "self_attn.o_proj.weight"],
        "norm.weight": weights["model.norm.weight"],
        "lm_head.weight": weights["model.embed_tokens.weight"],
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool),
    }
    for p in ("q", "k", "v"):
        w = weights[src + f"self_attn.{p}_proj.weight"]
        state[f"midlayer.self_attn.{p}_proj.weight"] = torch.cat([zeros(w), w], 1)
    for p in ("gate", "up", "down"):
        state[f"midlayer.mlp.{p}_proj.weight"] = weights[src + f"mlp.{p}_proj.weight"]
    draft.load_state_dict({k: v.float() for k, v in state.items()} | {"d2t": state["d2t"], "t2d": state["t2d"]})
    return export_draft(draft, out_dir, SMOLLM2_EAGLE_IDS, bos_token_id=1, eos_token_id=2,
                        capture_points=SMOLLM2_POINTS)


@pytest.fixture(scope="module")
def copy_head(smollm2_path, tmp_path_factory) -> Path:
    return layer_copy_head(smollm2_path, tmp_path_factory.mktemp("heads") / "layer27")


@pytest.mark.engine
def test_sglang_draft_reproduces_our_draft(smollm2_path, tmp_path):
    """SGLang's LlamaForCausalLMEagle3, loaded from our export, computes what our draft class
    computes on the same inputs (its first forward: the draft extend over the prompt), and hands its
    first draft decode step the state our `step` hands on (the contract docs/EAGLE3.md §1.5 builds
    on: SGLang's model returns that state, its worker stores it for the next step)."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=576, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=49152, draft_vocab_size=512, target_hidden_size=576,
                      rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        used = torch.sort(torch.randperm(49152)[:512]).values
        draft.d2t.copy_(used - torch.arange(512))
        draft.t2d.zero_()
        draft.t2d[used] = True
    export = export_draft(draft, tmp_path / "export", SMOLLM2_EAGLE_IDS, 1, 2, capture_points=SMOLLM2_POINTS)
    probe = tmp_path / "probe"
    probe.mkdir()
    out = subprocess.run([PY, str(ROOT / "tests" / "fixtures" / "sglang_draft_probe.py"), smollm2_path, str(export), str(probe)],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "SPECFORGE_PROBE_DIR": str(probe), "OMP_NUM_THREADS": "1",
                              "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    calls = sorted(probe.glob("call_*.pt"))
    assert calls, "the probe recorded no draft forward"
    first = torch.load(calls[0])
    assert "EXTEND" in first["mode"] and int(first["positions"][0]) == 0, first["mode"]

    embed, _ = load_embedding_and_head(smollm2_path)
    ours = load_exported_draft(export, embed).eval()
    with torch.no_grad():
        n = len(first["input_ids"])
        hidden = ours.project(first["hidden_in"][None].float())
        handed_on = ours.step(first["input_ids"][None], hidden, first["positions"][None], [])[0]
        normed = ours.norm(handed_on)[0]
        logits = ours.lm_head(normed)
    sglang_logits = first["normed"] @ first["lm_head"].T
    assert first["normed"].shape == (n, 576)
    assert (normed - first["normed"]).abs().max() < 1e-4
    assert (logits - sglang_logits).abs().max() < 1e-4 * max(1.0, logits.abs().max().item())
    second = torch.load(calls[1])
    assert "DECODE" in second["mode"] and len(second["hidden_in"]) == 1, second["mode"]
    assert (second["hidden_in"][0] - handed_on[0, -1]).abs().max() < 1e-4 * handed_on.abs().max()
    if first["hot_token_id"] is not None:  # the draft-to-target vocab map SGLang uses
        assert torch.equal(first["hot_token_id"].long().cpu(), draft_to_target(ours.d2t))


@pytest.mark.engine
def test_eval_cli_sglang_acceptance(smollm2_path, copy_head, tmp_path):
    """SGLang's speculative output equals its greedy output token for token; its acceptance
    length equals our replay of the same head; the layer-copy head beats an untrained head."""
    out_dir = tmp_path / "eval"
    cmd = [PY, "-m", "specforge_k25.eval", f"export_dir={copy_head}", "eval.prompt_sets=[mtbench,humaneval]",
           "eval.num_prompts=2", "eval.max_new_tokens=20", "eval.chains=[[3,1,4]]", f"eval.output={out_dir}",
           "data.num_samples=4", "data.heldout_samples=2", "train.progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((out_dir / "eval.json").read_text())
    rows = {(r["method"], r["chain"], r["prompt_set"]): r for r in results["rows"]}
    n_prompts = 4
    for head in ("trained", "untrained"):
        row = rows[(head, "3/1/4", "all")]
        assert row["outputs_differ_from_greedy"] == 0, row  # speculation never changes greedy output
        assert row["completion_tokens"] == rows[("nospec", "-", "all")]["completion_tokens"]
        steps = results["verify_steps_per_prompt"][f"{head} 3/1/4"]
        assert len(steps["sglang"]) == len(steps["replay"]) == n_prompts
        # SGLang's verify steps equal our replay's prompt by prompt (one prompt may differ by a step: fp32 ties)
        differ = [abs(a - b) for a, b in zip(steps["sglang"], steps["replay"]) if a != b]
        assert len(differ) <= 1 and max(differ, default=0) <= 1, steps
    copy, untrained = rows[("trained", "3/1/4", "all")], rows[("untrained", "3/1/4", "all")]
    accepted = copy["completion_tokens"] - n_prompts - copy["verify_steps"]  # drafts accepted in all
    assert accepted >= 2 and copy["al_sglang"] > untrained["al_sglang"], (copy, untrained)
    assert "ngram" in {m for m, _, _ in rows} and (out_dir / "eval.md").is_file() and (out_dir / "eval.png").is_file()
    assert "acceptance length" in out.stdout
