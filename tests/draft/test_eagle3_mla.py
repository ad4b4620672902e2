"""The MLA EAGLE-3 head (specforge_k25/draft/eagle3_mla): its TTT steps and loss against the
float64 loop reference (tests/fixtures/mla_ttt_reference.py), its RoPE / YaRN pieces by hand, its
serving export, and SGLang's own `Eagle3DeepseekV2ForCausalLM` on the same weights.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_ttt_reference import (YARN, reference_steps, reference_ttt_loss, rope_frequencies, tiny_mla_config,
                               tiny_mla_setup)
from specforge_k25.draft.eagle3_mla.export import (LAYER_PREFIX, expected_shapes, load_export,
                                                   validate_export)
from specforge_k25.draft.eagle3_mla.model import (Eagle3MLADraft, MLADraftConfig, apply_rope_interleaved,
                                                  rope_cos_sin, rope_inv_freq, softmax_scale)
from specforge_k25.draft.objective import Teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.export.serving import export_draft
from specforge_k25.target_engine.layers import DEEPSEEK_RULE, sglang_layer_ids

K = 3  # TTT steps
ROOT = Path(__file__).resolve().parents[2]


def unroll(draft, aux, step_ids, K):
    """Our module through K TTT steps: ([hidden_k [B, T, H]], [logits_k [B, T, Vd]])."""
    B, T = step_ids[0].shape
    hidden, past, hs, ls = draft.project(aux), [], [], []
    for k in range(K):
        hidden, cache = draft.step(step_ids[k], hidden, (torch.arange(T) + k).expand(B, T), past)
        past.append(cache)
        hs.append(hidden)
        ls.append(draft.logits(hidden))
    return hs, ls


@pytest.fixture(scope="module")
def case():
    """4 aux states (fc takes any count), YaRN factor 8 over 16 positions: the rope ramp and the
    softmax mscale both matter at these positions. Reference outputs kept with their graph."""
    cfg, draft, _, input_ids, _, _, aux, _, _ = tiny_mla_setup(0, num_aux_hidden_states=4)
    step_ids = [torch.randint(0, cfg.vocab_size, input_ids.shape) for _ in range(K)]
    ref_h, ref_l = reference_steps(draft, aux, step_ids, K)
    return draft, aux, step_ids, ref_h, ref_l


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def test_steps_and_grads_equal_the_float64_reference(case):
    draft, aux, step_ids, ref_h, ref_l = case
    hs, ls = unroll(draft, aux, step_ids, K)
    for k in range(K):
        for b in range(aux.shape[0]):
            assert _rel(hs[k][b], torch.stack(ref_h[k][b])) < 1e-12, (k, b)
            assert _rel(ls[k][b], torch.stack(ref_l[k][b])) < 1e-12, (k, b)
    # gradients through every step's cache: a fixed random functional of all outputs
    g = torch.Generator().manual_seed(5)
    weights = [(torch.randn(h.shape, generator=g, dtype=h.dtype), torch.randn(l.shape, generator=g, dtype=l.dtype))
               for h, l in zip(hs, ls)]
    ours = sum((h * wh).sum() + (l * wl).sum() for (h, l), (wh, wl) in zip(zip(hs, ls), weights))
    ref = sum((torch.stack([torch.stack(ref_h[k][b]) for b in range(len(ref_h[k]))]) * wh).sum()
              + (torch.stack([torch.stack(ref_l[k][b]) for b in range(len(ref_l[k]))]) * wl).sum()
              for k, (wh, wl) in enumerate(weights))
    params = draft.trainable_parameters()
    assert "embed_tokens.weight" not in {n for n, p in draft.named_parameters() if p.requires_grad}
    for p, got, want in zip(params, torch.autograd.grad(ours, params), torch.autograd.grad(ref, params)):
        assert want.abs().max() > 0
        assert _rel(got, want) < 1e-10


def test_fp32_module_is_within_1e5_of_the_float64_reference(case):
    draft, aux, step_ids, ref_h, ref_l = case
    with torch.no_grad():
        hs, ls = unroll(copy.deepcopy(draft).float(), aux.float(), step_ids, K)
    assert hs[0].dtype == torch.float32
    for k in range(K):
        for b in range(aux.shape[0]):
            assert _rel(hs[k][b], torch.stack(ref_h[k][b]).detach()) < 1e-5, (k, b)
            assert _rel(ls[k][b], torch.stack(ref_l[k][b]).detach()) < 1e-5, (k, b)


def test_ttt_loss_over_the_mla_head_equals_the_reference_loss():
    """draft/eagle3/loss.py's ttt_loss, unchanged, over this head: loss, counts and gradients; the
    recomputed (checkpointed) steps give the same loss."""
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = tiny_mla_setup(1)
    full = final @ lm_head_full.T
    used = torch.arange(cfg.draft_vocab_size) + d2t
    inv = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
    inv[used] = torch.arange(cfg.draft_vocab_size)
    teacher = Teacher(full[..., used], torch.logsumexp(full, -1), inv[full.argmax(-1)])
    res = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K)
    params = draft.trainable_parameters()
    got = torch.autograd.grad(res.loss, params)
    ref_loss, ref_ploss, ref_counted, ref_correct = reference_ttt_loss(
        draft, aux, input_ids, loss_mask, lengths, final, lm_head_full, d2t, K)
    assert all(c > 0 for c in ref_counted), ref_counted
    assert res.counted.tolist() == ref_counted and res.correct.tolist() == ref_correct
    torch.testing.assert_close(res.loss, ref_loss.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(res.ploss, torch.stack(ref_ploss).detach(), rtol=1e-10, atol=1e-12)
    for p, g, want in zip(params, got, torch.autograd.grad(ref_loss, params)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-10 * float(want.abs().max()))
    again = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K, checkpoint=True)
    assert torch.equal(again.loss, res.loss)


def test_yarn_frequencies_scale_and_interleaved_layout():
    cfg = tiny_mla_config(qk_rope_head_dim=16)
    ours, ref = rope_inv_freq(cfg), torch.tensor(rope_frequencies(cfg), dtype=torch.float64)
    torch.testing.assert_close(ours, ref, rtol=1e-15, atol=0)
    original = cfg.rope_theta ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    kept, divided = torch.isclose(ours, original), torch.isclose(ours, original / YARN["factor"])
    assert kept.any() and divided.any() and not (kept | divided).all()  # the ramp has all three parts
    assert softmax_scale(cfg) == pytest.approx((1 + 0.1 * math.log(8.0)) ** 2 / math.sqrt(6 + 16), rel=1e-15)
    plain = tiny_mla_config(rope_scaling={})  # factor 1: plain RoPE, plain 1/sqrt(d) scale
    plain_freqs = plain.rope_theta ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    torch.testing.assert_close(rope_inv_freq(plain), plain_freqs)
    assert softmax_scale(plain) == 1 / math.sqrt(6 + 4)
    # pair (0, 1) rotates together (DeepSeek / GPT-J layout), not (0, d/2) as rotate-half would
    cos, sin = rope_cos_sin(torch.tensor([[3]]), plain, torch.float64)
    out = apply_rope_interleaved(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), cos, sin)[0, 0, 0]
    torch.testing.assert_close(out, torch.tensor([math.cos(3), math.sin(3), 0.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("bad, match", [
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(qk_rope_head_dim=5), "even"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "YaRN"),
    (dict(rope_scaling={"factor": 2.0, "low_freq_factor": 1.0}), "low_freq_factor"),
    (dict(rope_scaling={"factor": 2.0, "apply_yarn_scaling": False}), "apply_yarn_scaling"),
    (dict(rope_scaling={"factor": 2.0, "rope_theta": 10000.0}), "differs"),
    (dict(draft_vocab_size=51), "exceeds"),
])
def test_config_is_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        Eagle3MLADraft(tiny_mla_config(**bad))


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------

POINTS = [2, 4, 6]  # capture points of an 8-layer DeepSeek / Kimi target


def _export(tmp_path, **overrides):
    cfg, draft, *_ = tiny_mla_setup(2, **overrides)
    draft = draft.float()
    ids = sglang_layer_ids(POINTS[: cfg.num_aux_hidden_states], DEEPSEEK_RULE)
    return draft, export_draft(draft, tmp_path / "export", ids, bos_token_id=1, eos_token_id=[2, 3],
                               capture_points=POINTS[: cfg.num_aux_hidden_states])


def test_export_layout_config_and_round_trip(tmp_path):
    draft, out = _export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    cfg = draft.cfg
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == POINTS  # SGLang (DeepSeek rule)
    assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["layer_ids"] == POINTS  # vLLM
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "draft_vocab_size", "vocab_size", "rope_theta"):
        assert config[key] == getattr(cfg, key), key
    assert config["rope_scaling"] == YARN
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(expected_shapes(cfg)) | {"d2t", "t2d"}  # a reduced draft vocab: both maps
    assert not any(n.startswith("midlayer.") or n.startswith("embed_tokens") for n in tensors)
    assert tensors[LAYER_PREFIX + "self_attn.kv_b_proj.weight"].shape == (2 * (6 + 5), 10)

    back = load_export(out, draft.embed_tokens.weight)
    assert back.cfg == cfg
    for name, t in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_sglang_reads_the_config_as_a_deepseek_v3_config(tmp_path):
    """SGLang 0.5.23 reads model_type kimi_k2 (written for vLLM, which refuses deepseek_v3 drafts) as
    DeepseekV3Config, and its `rope_parameters` (transformers 5) from our rope_theta + rope_scaling
    (kimi_k25_eagle3.py reads rope_theta and the YaRN fields from it)."""
    from sglang.srt.utils.hf_transformers.config import get_config

    draft, out = _export(tmp_path)
    hf = get_config(str(out), trust_remote_code=False)
    assert "DeepseekV3Config" in [c.__name__ for c in type(hf).__mro__] and hf.q_lora_rank == draft.cfg.q_lora_rank
    rope = hf.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["rope_theta"] == draft.cfg.rope_theta
    assert {k: rope[k] for k in YARN if k != "type"} == {k: v for k, v in YARN.items() if k != "type"}


def test_export_of_any_aux_count_and_a_full_vocab(tmp_path):
    draft, out = _export(tmp_path, num_aux_hidden_states=2, draft_vocab_size=50)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == POINTS[:2]
    assert load_export(out, draft.embed_tokens.weight).fc.weight.shape == (16, 2 * 16)


def test_validate_export_names_each_problem(tmp_path):
    _, out = _export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4]  # SGLang would size fc for 2 states
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.zeros(50, 16)
    del tensors[LAYER_PREFIX + "self_attn.q_a_layernorm.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError) as err:
        validate_export(out)
    text = str(err.value)
    assert "fc.weight has shape (16, 48), expected (16, 32)" in text
    assert "missing tensor layers.0.self_attn.q_a_layernorm.weight" in text
    assert "unexpected tensor embed_tokens.weight" in text
    assert "vLLM ids" in text


# ----------------------------------------------------------------------------------------------
# SGLang's own draft model on the same weights
# ----------------------------------------------------------------------------------------------

# Drafts behind the three CPU targets (their hidden size, vocab and embedding); kv_lora_rank +
# qk_rope_head_dim equal in all three (the probe's one MLA KV pool serves them all).
BEHIND = {
    # SmolLM2 (H 576): plain RoPE (YaRN factor 1, theta as SmolLM2's), reduced vocab, 4 aux states
    "smollm2": dict(hidden_size=576, intermediate_size=128, num_attention_heads=3, q_lora_rank=64, kv_lora_rank=32,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48, draft_vocab_size=512,
                    num_aux_hidden_states=4, rope_theta=100000.0, rope_scaling={}, max_position_embeddings=8192),
    # tiny DeepSeek-V3 (H 128): its YaRN (factor 8: rope ramp and softmax mscale), full vocab
    "tiny_deepseek": dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, q_lora_rank=48,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                          draft_vocab_size=49152, rope_theta=50000.0, max_position_embeddings=4096,
                          rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # tiny Kimi-K2.5 (its embedding under language_model.): same YaRN, reduced vocab
    "tiny_kimi": dict(hidden_size=128, intermediate_size=64, num_attention_heads=2, q_lora_rank=40, kv_lora_rank=32,
                      qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=16, draft_vocab_size=1000,
                      rope_theta=50000.0, max_position_embeddings=4096,
                      rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
LENGTHS = [23, 11]  # two requests in one extend batch


def _random_draft(sizes: dict, vocab_size: int, seed: int):
    torch.manual_seed(seed)
    cfg = MLADraftConfig(**sizes, vocab_size=vocab_size, target_hidden_size=sizes["hidden_size"], rms_norm_eps=1e-6)
    draft = Eagle3MLADraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):  # not ones: a norm SGLang failed to load would show
                p.copy_(1 + 0.2 * torch.randn_like(p))
        used = torch.sort(torch.randperm(vocab_size)[: cfg.draft_vocab_size]).values
        draft.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


@pytest.fixture(scope="module")
def sglang_runs(smollm2_path, tiny_deepseek_path, tmp_path_factory):
    """Our export of a random draft behind each target, run by SGLang's class (the probe)."""
    from specforge_k25.target_engine.hf_config import load_embedding_and_head
    from specforge_k25.target_engine.models import tiny_kimi_k25_path

    targets = {"smollm2": smollm2_path, "tiny_deepseek": tiny_deepseek_path,
               "tiny_kimi": str(tiny_kimi_k25_path(Path(smollm2_path)))}
    root = tmp_path_factory.mktemp("mla_sglang")
    cases = {}
    for seed, (name, sizes) in enumerate(BEHIND.items()):
        embed = load_embedding_and_head(targets[name])[0].float()
        draft = _random_draft(sizes, embed.shape[0], seed)
        draft.embed_tokens.weight.data.copy_(embed)
        n_aux = draft.cfg.num_aux_hidden_states
        points = POINTS + [7] if n_aux == 4 else POINTS
        export_draft(draft, root / name / "export", sglang_layer_ids(points, DEEPSEEK_RULE), 1, 2,
                     capture_points=points)
        g = torch.Generator().manual_seed(100 + seed)
        seqs = [torch.randint(0, embed.shape[0], (n,), generator=g) for n in LENGTHS]
        aux = [torch.randn(n, n_aux * draft.cfg.target_hidden_size, generator=g) for n in LENGTHS]
        torch.save({"embed": embed, "seqs": seqs, "aux": aux}, root / name / "inputs.pt")
        cases[name] = (draft.eval(), seqs, aux)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "sglang_mla_draft_probe.py"), smollm2_path,
                          *[str(root / name) for name in BEHIND]], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return {name: (*cases[name], torch.load(root / name / "sglang.pt")) for name in BEHIND}


@pytest.mark.engine
@pytest.mark.parametrize("behind", list(BEHIND))
@pytest.mark.parametrize("path", ["absorbed", "mha"])
def test_sglang_draft_model_equals_ours(sglang_runs, behind, path):
    """SGLang's Eagle3DeepseekV2ForCausalLM, loaded from our export, on the draft's prefill (TTT
    step 0) through both of its DeepSeek attention paths: the pre-norm hidden it hands the next
    draft step, its normed hidden, its logits (all tokens, and the LogitsProcessor's last-token
    ones) equal ours within 1e-5 relative, fp32; its draft-to-target map is our d2t (none at the full
    vocab, whose identity maps the export leaves out)."""
    from specforge_k25.draft.vocab import draft_to_target

    ours, seqs, aux, sg = sglang_runs[behind]  # the draft as trained, not reloaded: the export is under test too
    assert sg["class"] == "Eagle3DeepseekV2ForCausalLM" and sg["embed_is_target"]
    # CPU blocker: SGLang's set_embed calls torch.cuda.synchronize (kimi_k25_eagle3.py:415)
    assert "kimi_k25_eagle3.py:415" in (sg["set_embed_error"] or ""), sg["set_embed_error"]
    run = sg[path]
    starts = [0, LENGTHS[0]]
    with torch.no_grad():
        for i, (ids, a) in enumerate(zip(seqs, aux)):
            rows = slice(starts[i], starts[i] + len(ids))
            positions = run["positions"][rows]
            assert positions.tolist() == list(range(len(ids)))
            pre, _ = ours.step(ids[None], ours.project(a[None]), positions[None], [])
            logits = ours.logits(pre)[0]
            assert _rel(pre[0], run["prenorm"][rows]) < 1e-5
            assert _rel(ours.norm(pre)[0], run["normed"][rows]) < 1e-5
            head = sg["lm_head"][: ours.cfg.draft_vocab_size]  # SGLang pads its lm_head rows to a multiple of 64
            assert _rel(logits, run["normed"][rows] @ head.T) < 1e-5
            assert _rel(logits[-1], run["last_logits"][i]) < 1e-5
    used = draft_to_target(ours.d2t)
    if ours.cfg.draft_vocab_size == ours.cfg.vocab_size:  # full vocab: no d2t exported, SGLang maps nothing
        assert sg["hot_token_id"] is None and torch.equal(used, torch.arange(ours.cfg.vocab_size))
    else:
        assert torch.equal(sg["hot_token_id"].long(), used)
