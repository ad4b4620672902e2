"""A tiny Kimi-K2.5-shaped target through SGLang's own `KimiK25ForConditionalGeneration` class.

The checkpoint (`tiny_kimi_k25_path`) is laid out like Kimi-K2.5: `model_type` kimi_k25, the
DeepSeek-V3 text model (MLA + MoE + YaRN) in `text_config` under the `language_model.` weight
prefix, and a 1-block MoonViT. The reference is HF transformers' `DeepseekV3ForCausalLM` built
from `text_config` with the prefix stripped (no SGLang code involved).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge_k25.target_engine.hf_config import load_embedding_and_head, read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import default_capture_points, layer_id_rule

KIMI = "KimiK25ForConditionalGeneration"


@pytest.fixture(scope="session")
def tiny_kimi_path(smollm2_path):
    from specforge_k25.target_engine.models import tiny_kimi_k25_path

    return str(tiny_kimi_k25_path(smollm2_path))


def test_tiny_kimi_checkpoint_is_kimi_shaped(tiny_kimi_path):
    config = json.loads(Path(tiny_kimi_path, "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and config["architectures"] == [KIMI]
    text = config["text_config"]
    assert text["architectures"] == ["DeepseekV3ForCausalLM"] and text["num_hidden_layers"] == 8
    assert text["kv_lora_rank"] > 0 and text["n_routed_experts"] > 1 and text["first_k_dense_replace"] == 1
    assert text["rope_parameters"]["rope_type"] == "yarn" and text["moe_layer_freq"] == 1
    assert text["num_nextn_predict_layers"] == 0  # Kimi-K2.5 has no MTP layer
    with safe_open(Path(tiny_kimi_path, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in keys and "language_model.lm_head.weight" in keys
    assert not any(k.startswith("model.") or k == "lm_head.weight" for k in keys)  # text weights only under the prefix
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in keys)
    assert any(k.startswith("vision_tower.encoder.blocks.0.wqkv") for k in keys)

    info = read_target_info(tiny_kimi_path)  # architecture from the top level, text facts from text_config
    assert (info.architecture, info.num_layers, info.hidden_size, info.vocab_size) == (KIMI, 8, 128, text["vocab_size"])
    assert (info.bos_token_id, info.eos_token_id) == (text["bos_token_id"], text["eos_token_id"])
    assert layer_id_rule(info.architecture) == "deepseek"


def test_kimi_embedding_and_head_equal_hf_reference(tiny_kimi_path):
    """`language_model.model.embed_tokens.weight` / `language_model.lm_head.weight` read tensor by
    tensor == the HF reference's (untied: the two differ)."""
    embed, head = load_embedding_and_head(tiny_kimi_path)
    ref = HFTarget(tiny_kimi_path, [2, 4, 5]).model
    assert torch.equal(embed, ref.model.embed_tokens.weight)
    assert torch.equal(head, ref.lm_head.weight)
    assert not torch.equal(embed, head)


def test_hf_reference_refuses_a_partial_kimi_checkpoint(tiny_kimi_path, tmp_path):
    """The reference must not silently run with randomly initialised text weights."""
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if Path(tiny_kimi_path, name).is_file():
            (tmp_path / name).write_bytes(Path(tiny_kimi_path, name).read_bytes())
    weights = load_file(Path(tiny_kimi_path, "model.safetensors"))
    del weights["language_model.model.layers.3.self_attn.kv_a_layernorm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="did not load cleanly"):
        HFTarget(str(tmp_path), [2, 4, 5])


def test_target_tiny_kimi_config_resolves_to_the_tiny_kimi(tiny_kimi_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import specforge_k25.train.__main__  # noqa: F401  (registers the schema)
    from specforge_k25.target_engine.models import resolve_target_path

    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        job = OmegaConf.to_object(compose(config_name="config", overrides=["target=tiny_kimi"]))
    assert job.target.builtin == "tiny_kimi" and job.target.aux_layers is None
    assert resolve_target_path(job.target) == tiny_kimi_path


@pytest.mark.engine
def test_sglang_kimi_hidden_states_equal_hf(tiny_kimi_path, sglang_capture):
    """Aux (3 capture points) and final post-norm states from SGLang's Kimi class == HF, fp32 <= 1e-4."""
    info = read_target_info(tiny_kimi_path)
    points = default_capture_points(info.num_layers)
    assert points == [2, 4, 5] and len(set(points)) == 3
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (23, 7, 41)]
    got = sglang_capture(tiny_kimi_path, points, seqs)
    ref = HFTarget(tiny_kimi_path, points)
    expected = ref.forward(seqs)
    assert [n for lengths, _, _ in got for n in lengths] == [23, 7, 41]
    aux = torch.cat([a for _, a, _ in got])
    final = torch.cat([f for _, _, f in got])
    H = info.hidden_size
    assert aux.shape == (71, 3 * H) and final.shape == (71, H)
    for name, a, r in (("aux", aux, expected.aux_hidden), ("final", final, expected.final_hidden)):
        diff = (a - r).abs().max().item()
        print(f"kimi {name}: max |diff| {diff:.3g} (max |ref| {r.abs().max().item():.3g})")
        assert diff <= 1e-4, f"kimi {name}: max |diff| {diff:.3g}"
    # the captured layers are exactly the configured ones: the neighbouring layers do not match
    with torch.no_grad():
        hs = ref.model.model(seqs[0][None], output_hidden_states=True).hidden_states
    for k, p in enumerate(points):
        block = aux[:23, k * H:(k + 1) * H]
        assert torch.allclose(block, hs[p][0], atol=1e-4, rtol=0)
        assert not torch.allclose(block, hs[p + 1][0], atol=1e-3, rtol=0)
        assert not torch.allclose(block, hs[p - 1][0], atol=1e-3, rtol=0)


@pytest.mark.engine
def test_kimi_as_two_pipeline_stages_equals_hf(tiny_kimi_path, sglang_capture):
    """KimiK25ForConditionalGeneration as two SGLang pipeline stages through the stream (hw.target_pp=2,
    dedicated: the last stage fills the ring): stage 1 starts from the proxies, not from the
    multimodal wrapper's embedding; its aux and final states == HF, fp32 <= 1e-4."""
    info = read_target_info(tiny_kimi_path)
    points = default_capture_points(info.num_layers)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (23, 7, 41)]
    got = sglang_capture(tiny_kimi_path, points, seqs, pp_size=2, num_threads=1)
    expected = HFTarget(tiny_kimi_path, points).forward(seqs)
    assert [n for lengths, _, _ in got for n in lengths] == [23, 7, 41]
    for name, a, r in (("aux", torch.cat([a for _, a, _ in got]), expected.aux_hidden),
                       ("final", torch.cat([f for _, _, f in got]), expected.final_hidden)):
        diff = (a - r).abs().max().item()
        print(f"kimi PP2 {name}: max |diff| {diff:.3g}")
        assert a.shape == r.shape and diff <= 1e-4, f"kimi PP2 {name}: max |diff| {diff:.3g}"


_LAYER_IDS_PROBE = """
    import json, sys, torch
    from specforge_k25.draft.eagle3.export import serving_config
    from specforge_k25.draft.eagle3.model import DraftConfig
    from specforge_k25.target_engine.hf_config import load_embedding_and_head, read_target_info
    from specforge_k25.target_engine.layers import default_capture_points, layer_id_rule, sglang_layer_ids, vllm_layer_ids
    from specforge_k25.target_engine.sglang_engine import SGLangTarget

    if __name__ == "__main__":
        path, out = sys.argv[1], sys.argv[2]
        info = read_target_info(path)
        points = default_capture_points(info.num_layers)
        target = SGLangTarget(path, info.architecture, points, num_threads=2)
        model = target.model
        text = model.language_model.model
        result = {"class": type(model).__name__, "passed_ids": target.layer_ids,
                  "captured_at_start": list(text.layers_to_capture)}
        # What SGLang does with a served draft: read eagle_config from the exported folder's config
        # and hand the ids to the target's set_eagle3_layers_to_capture.
        cfg = DraftConfig(hidden_size=info.hidden_size, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=info.vocab_size, draft_vocab_size=64,
                          target_hidden_size=info.hidden_size)
        exported = {}
        for trained in ([2, 4, 5], [3, 5, 6], [2, 3, 7]):
            ids = sglang_layer_ids(trained, layer_id_rule(info.architecture))
            eagle = json.loads(json.dumps(serving_config(cfg, ids, vllm_layer_ids(trained), 1, 2, "float32")))["eagle_config"]
            model.set_eagle3_layers_to_capture(eagle["eagle_aux_hidden_state_layer_ids"])
            exported[str(trained)] = list(text.layers_to_capture)
        result["exported"] = exported
        # ... and the states captured after re-setting them are those layers' (checked against HF outside)
        ids = sglang_layer_ids([3, 5, 6], layer_id_rule(info.architecture))
        model.set_eagle3_layers_to_capture(ids)
        seq = torch.arange(5, 40)
        res = target.forward([seq])
        embed_ref, head_ref = load_embedding_and_head(path)
        embed, head = model.get_embed_and_head()
        qkv = model.vision_tower.encoder.blocks[0].attn.qkv_proj.weight
        from safetensors import safe_open
        with safe_open(path + "/model.safetensors", framework="pt") as f:
            wqkv = f.get_tensor("vision_tower.encoder.blocks.0.wqkv.weight")
        result["embed_equal"] = torch.equal(embed, embed_ref)
        result["head_equal"] = torch.equal(head, head_ref)
        result["vision_loaded"] = torch.equal(qkv, wqkv)
        torch.save({"result": result, "seq": seq, "aux": res.aux_hidden}, out)
"""


@pytest.mark.engine
def test_exported_layer_ids_make_sglang_kimi_capture_the_trained_layers(tiny_kimi_path, tmp_path):
    """Through SGLang's Kimi class itself: the ids we pass at training time and the ids written into
    the exported eagle_config make `language_model.model.layers_to_capture` == the capture points."""
    out = tmp_path / "probe.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = tmp_path / "probe.py"  # a file, not -c: SGLang may spawn helpers that re-import __main__
    script.write_text(textwrap.dedent(_LAYER_IDS_PROBE))
    proc = subprocess.run([sys.executable, str(script), tiny_kimi_path, str(out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = torch.load(out, weights_only=False)
    r = probe["result"]
    assert r["class"] == KIMI
    assert r["passed_ids"] == [2, 4, 5] and r["captured_at_start"] == [2, 4, 5]
    for trained, captured in r["exported"].items():
        assert captured == json.loads(trained), (trained, captured)
    assert r["embed_equal"] and r["head_equal"]  # SGLang's embed/head == what the trainer reads from disk
    assert r["vision_loaded"]  # the tiny MoonViT weights went through SGLang's renaming (wqkv -> attn.qkv_proj)
    ref = HFTarget(tiny_kimi_path, [3, 5, 6]).forward([probe["seq"]])
    diff = (probe["aux"] - ref.aux_hidden).abs().max().item()
    assert diff <= 1e-4, f"after set_eagle3_layers_to_capture({[3, 5, 6]}): max |diff| {diff:.3g}"
