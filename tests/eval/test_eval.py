"""`python -m specforge_k25.eval` end to end on CPU with SGLang's own speculative decoding, for a head
of each draft method, and SGLang's EAGLE-3 draft model against ours on the same inputs.

Heads with some acceptance are built without training, from SmolLM2's own weights:
  * eagle3 (`layer_copy_head`): its one decoder layer is a copy of SmolLM2's layer 27 reading the
    captured input of that layer (the third aux state), its head the target's (tied) embedding
    over the full vocabulary. It predicts roughly what the target predicts one position earlier,
    so it is right mainly where the output repeats itself: a weak head.
  * eagle3_mla (`mla_induction_head`): an induction head in MLA form, which proposes the token that
    followed the last occurrence(s) of the current token, as prompt lookup does (HumanEval answers
    repeat their prompt's signature). Its key at position s is the identity of x[s], read off the
    first aux state (input of layer 2) by a linear probe fitted on the target's states; its query
    is the embedding of the root token, its value the embedding of the token after s.
Their accepted drafts make the SGLang-vs-replay comparison non-trivial. The MLA head's proposals
are right at every chain depth (acc_k 0.23, 0.12, 0.12 on the eval's prompts, the copy head's
0.04, 0.07, 0.05), and an off-by-one SGLang layer id in its export changes its acceptance.
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

from specforge_k25.draft.eagle3_mla.model import Eagle3MLADraft, MLADraftConfig
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import draft_to_target
from specforge_k25.export.serving import export_draft, load_exported_draft
from specforge_k25.target_engine.hf_config import load_embedding_and_head

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_EAGLE_IDS = [1, 14, 26]  # capture points [2, 15, 27] (tests/target_engine/test_target.py checks the rule)
SMOLLM2_POINTS = [2, 15, 27]
DRAFT_VOCAB_LOW = 8192  # the MLA head's draft vocab: these lowest ids + the tokens its probe was fitted on


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


def token_probe(target: str, point: int = SMOLLM2_POINTS[0], texts: int = 15,
                ridge: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [H, H], ids): W maps the normed target state at capture point `point` to the normed
    embedding of its own token, least squares (ridge) over the last `texts` MT-bench and HumanEval
    prompts (not the eval's own), both sides normed as the draft's RMSNorms give them (rms 1);
    ids are the tokens of those texts."""
    from transformers import AutoTokenizer

    from specforge_k25.eval.prompts import humaneval_prompts, mtbench_questions
    from specforge_k25.target_engine.hf_reference import load_text_model

    tokenizer = AutoTokenizer.from_pretrained(target)
    seqs = [torch.tensor(tokenizer(t)["input_ids"]) for t in mtbench_questions()[-texts:] + humaneval_prompts()[-texts:]]
    model = load_text_model(target)
    model.model.layers = model.model.layers[: point + 1]  # the input of layer `point` is all it needs
    with torch.no_grad():
        states = torch.cat([model.model(ids[None], output_hidden_states=True).hidden_states[point][0] for ids in seqs])
    embed = load_embedding_and_head(target)[0].float()[torch.cat(seqs)]
    H = states.shape[1]
    x, y = (torch.nn.functional.normalize(t, dim=-1) * H ** 0.5 for t in (states, embed))
    return torch.linalg.solve(x.T @ x + ridge * torch.eye(H), x.T @ y).T, torch.cat(seqs)


def mla_induction_head(target: str, out_dir: Path, probe: torch.Tensor, vocab: torch.Tensor, query_scale: float = 1.0,
                       residual_scale: float = 0.01, out_scale: float = 10.0, rope_dim: int = 16,
                       rope_scale: float = 0.05) -> Path:
    """One head (q_lora H, kv_lora 2H, nope = v = H). The attention input is [e | h] = [norm(embedding
    of the root x[t+1]), norm(fc(aux))]; fc keeps the first aux state (scaled down: the residual it
    also is stays small). The latent is [e | h] itself (kv_a_proj = I; norming a normed vector keeps
    it), the key `probe` h (the identity of x[s]), the value e (x[s+1]); the query is e. Matching
    keys score ~H / sqrt(H + dr) ~ 24 above the rest, so attention lands on earlier occurrences of
    x[t+1] and o_proj hands their successors' embeddings to a head of normed embeddings over the
    draft vocab `vocab` (sorted target ids, so d2t is not trivial). The MLP is off (zero); small
    random rope rows keep the rope path in play."""
    cfg_json = json.loads(Path(target, "config.json").read_text())
    embed = load_embedding_and_head(target)[0].float()
    V, H = embed.shape
    cfg = MLADraftConfig(hidden_size=H, intermediate_size=8, num_attention_heads=1, q_lora_rank=H, kv_lora_rank=2 * H,
                         qk_nope_head_dim=H, qk_rope_head_dim=rope_dim, v_head_dim=H, vocab_size=V,
                         draft_vocab_size=len(vocab),
                         target_hidden_size=H, rms_norm_eps=cfg_json["rms_norm_eps"],
                         rope_theta=cfg_json.get("rope_theta") or cfg_json["rope_parameters"]["rope_theta"],
                         max_position_embeddings=cfg_json["max_position_embeddings"])
    g = torch.Generator().manual_seed(0)
    eye, zero = torch.eye(H), torch.zeros(H, H)
    a = "midlayer.self_attn."
    state = {
        "fc.weight": torch.cat([residual_scale * eye, torch.zeros(H, 2 * H)], 1),  # the first aux state
        "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
        a + "q_a_proj.weight": torch.cat([eye, zero], 1), a + "q_a_layernorm.weight": torch.ones(H),
        a + "q_b_proj.weight": torch.cat([query_scale * eye, rope_scale * torch.randn(rope_dim, H, generator=g)]),
        a + "kv_a_proj_with_mqa.weight": torch.cat([torch.eye(2 * H), rope_scale * torch.randn(rope_dim, 2 * H, generator=g)]),
        a + "kv_a_layernorm.weight": torch.ones(2 * H),
        a + "kv_b_proj.weight": torch.cat([torch.cat([zero, probe], 1), torch.cat([eye, zero], 1)]),  # key | value
        a + "o_proj.weight": out_scale * eye,
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": torch.zeros(8, H), "midlayer.mlp.up_proj.weight": torch.zeros(8, H),
        "midlayer.mlp.down_proj.weight": torch.zeros(H, 8),
        "norm.weight": torch.ones(H), "lm_head.weight": torch.nn.functional.normalize(embed[vocab], dim=-1),
        "embed_tokens.weight": embed,
        "d2t": vocab - torch.arange(len(vocab)), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, vocab, True),
    }
    draft = Eagle3MLADraft(cfg)
    draft.load_state_dict(state)
    return export_draft(draft, out_dir, SMOLLM2_EAGLE_IDS, bos_token_id=1, eos_token_id=2,
                        capture_points=SMOLLM2_POINTS)


@pytest.fixture(scope="module")
def copy_head(smollm2_path, tmp_path_factory) -> Path:
    return layer_copy_head(smollm2_path, tmp_path_factory.mktemp("heads") / "layer27")


@pytest.fixture(scope="module")
def mla_head(smollm2_path, tmp_path_factory) -> Path:
    probe, seen = token_probe(smollm2_path)
    vocab = torch.unique(torch.cat([torch.arange(DRAFT_VOCAB_LOW), seen]))  # sorted
    return mla_induction_head(smollm2_path, tmp_path_factory.mktemp("heads") / "induction_mla", probe, vocab)


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


N_PROMPTS = 3  # per prompt set
HEADS = {"trained": "eagle3", "mla_induction": "eagle3_mla"}  # row -> draft method
MIN_ACCEPTED = {"trained": 3, "mla_induction": 15}  # drafts accepted over all prompts (measured: 5 and 25)


@pytest.fixture(scope="module")
def eval_run(smollm2_path, copy_head, mla_head, tmp_path_factory):
    """One eval over the eagle3 copy head (export_dir) and the MLA induction head (eval.heads): one
    greedy run, one engine per head, one target pass for the replay (the untrained row, an engine
    run that adds little, is left out: test_eval_heads checks how it is built)."""
    out_dir = tmp_path_factory.mktemp("eval")
    cmd = [PY, "-m", "specforge_k25.eval", f"export_dir={copy_head}", f"+eval.heads.mla_induction={mla_head}",
           "eval.methods=[nospec,ngram,trained]", "eval.prompt_sets=[mtbench,humaneval]",
           f"eval.num_prompts={N_PROMPTS}", "eval.max_new_tokens=24", "eval.chains=[[3,1,4]]", f"eval.output={out_dir}",
           "data.num_samples=4", "data.heldout_samples=2", "train.progress=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((out_dir / "eval.json").read_text()), out_dir, out.stdout


@pytest.mark.engine
@pytest.mark.parametrize("head", list(HEADS))
def test_eval_cli_sglang_acceptance(eval_run, head):
    """SGLang's speculative output with each head (served by its method's SGLang arguments) equals
    its greedy output token for token, and its acceptance length equals our replay of the same head
    prompt by prompt; both heads have accepted drafts (a planted off-by-one layer id in the MLA
    export's SGLang ids made SGLang's verify steps differ from the replay's by 2 in one prompt)."""
    results, _, _ = eval_run
    rows = {(r["method"], r["chain"], r["prompt_set"]): r for r in results["rows"]}
    n_prompts = 2 * N_PROMPTS
    assert results["heads"][head]["method"] == HEADS[head]
    row = rows[(head, "3/1/4", "all")]
    assert row["outputs_differ_from_greedy"] == 0, row  # speculation never changes greedy output
    assert row["completion_tokens"] == rows[("nospec", "-", "all")]["completion_tokens"]
    steps = results["verify_steps_per_prompt"][f"{head} 3/1/4"]
    assert len(steps["sglang"]) == len(steps["replay"]) == n_prompts
    # SGLang's verify steps equal our replay's prompt by prompt (one prompt may differ by a step: fp32 ties)
    differ = [abs(a - b) for a, b in zip(steps["sglang"], steps["replay"]) if a != b]
    assert len(differ) <= 1 and max(differ, default=0) <= 1, steps
    accepted = row["completion_tokens"] - n_prompts - row["verify_steps"]  # drafts accepted in all
    assert accepted >= MIN_ACCEPTED[head], row


@pytest.mark.engine
def test_eval_cli_outputs(eval_run):
    """The baselines' rows, the table, the plot."""
    results, out_dir, stdout = eval_run
    assert {"nospec", "ngram"} <= {r["method"] for r in results["rows"]}
    assert (out_dir / "eval.md").is_file() and (out_dir / "eval.png").is_file()
    assert "acceptance length" in stdout


def test_eval_heads(smollm2_path, copy_head, tmp_path):
    """The eval's heads: the trained one and those of eval.heads as exported, whatever their method;
    the untrained one a fresh head of the run's method (the draft group), exported with the run's
    layer ids; a row name that is taken is refused."""
    from specforge_k25.config import compose_job
    from specforge_k25.draft.registry import get_method, method_of_export
    from specforge_k25.eval.run import _heads
    from specforge_k25.setup.run import prepare

    common = [f"export_dir={copy_head}", "draft=eagle3_mla", "draft.vocab_size=4096", "data.num_samples=4", "data.heldout_samples=2",
              "train.progress=false"]
    job = compose_job([*common, f"+eval.heads.again={copy_head}"], config_name="eval")
    setup = prepare(job)
    heads = _heads(job, setup, tmp_path)
    assert list(heads) == ["trained", "again", "untrained"] and heads["trained"] == copy_head
    assert [method_of_export(heads[h]).name for h in heads] == ["eagle3", "eagle3", "eagle3_mla"]
    untrained = load_exported_draft(heads["untrained"], load_embedding_and_head(smollm2_path)[0])
    assert type(untrained) is get_method("eagle3_mla").model_class
    assert untrained.cfg.kv_lora_rank == setup.draft_cfg.kv_lora_rank and untrained.cfg.draft_vocab_size == 4096
    config = json.loads((heads["untrained"] / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == setup.sglang_capture_ids == SMOLLM2_EAGLE_IDS
    with pytest.raises(ValueError, match="taken"):
        _heads(compose_job([*common, f"+eval.heads.ngram={copy_head}"], config_name="eval"), setup, tmp_path)
