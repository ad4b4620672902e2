"""Tests of the serving export (docs/EAGLE3.md §1 and §5): config.json fields, tensor names /
shapes / dtypes, exact round trip back into our draft class, validation of broken folders, and
replacement of an existing export folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.draft.registry import get_method
from specforge_k25.export.serving import export_draft, load_exported_draft, validate_export

H, I, NH, NKV, HD, V, VD = 32, 48, 4, 2, 8, 300, 50
LAYER_IDS = [1, 29, 57]  # SGLang's ids (Llama rule) of
POINTS = [2, 30, 58]  # these capture points, which are also vLLM's ids
BOS, EOS = 163584, [163585, 163586]  # eos as a list, as multi-eos targets write it


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


# docs/EAGLE3.md §1.3: every tensor of the serving checkpoint (no embedding), with its shape.
def serving_shapes(ht: int) -> dict[str, tuple[int, ...]]:
    return {
        "fc.weight": (H, 3 * ht),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, NH * HD),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "d2t": (VD,),
        "t2d": (V,),
    }


def make_draft(seed: int = 0, target_hidden_size: int = H, rope_theta: float = 10000.0,
               rms_norm_eps: float = 1e-6, max_pos: int = 4096, fc_norm: bool = False,
               norm_output: bool = False) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                      head_dim=HD, vocab_size=V, draft_vocab_size=VD, target_hidden_size=target_hidden_size,
                      rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, max_position_embeddings=max_pos,
                      fc_norm=fc_norm, norm_output=norm_output)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.startswith("fc_norm."):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # norms away from ones, so a mix-up shows
            else:
                p.copy_(torch.randn_like(p) * 0.2)
        d2t, t2d = build_vocab_maps(torch.randint(0, 1000, (V,)), VD)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


@pytest.fixture
def exported(tmp_path) -> tuple[Eagle3Draft, Path]:
    draft = make_draft(seed=1)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, capture_points=POINTS)
    return draft, out


# ------------------------------------------------------------------------------ 1. contents
@pytest.mark.parametrize("ht", [H, 48], ids=["H_eq_Ht", "H_ne_Ht"])
def test_export_config_and_tensors_match_serving_format(tmp_path, ht):
    draft = make_draft(seed=2, target_hidden_size=ht, rope_theta=50000.0, rms_norm_eps=1e-5, max_pos=8192)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, capture_points=POINTS)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    config = json.loads((out / "config.json").read_text())
    required = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS, "use_aux_hidden_state": True,
                         "layer_ids": POINTS},
        "eagle_aux_hidden_state_layer_ids": POINTS,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }
    for key, want in required.items():
        assert key in config, f"config.json lacks {key}"
        assert config[key] == want, f"config.{key}={config[key]!r}, expected {want!r}"
    # the draft is SwiGLU without biases: a serving loader that read other values would build another model
    assert config.get("hidden_act", "silu") == "silu"
    assert not config.get("attention_bias", False) and not config.get("mlp_bias", False)
    assert config.get("rope_scaling") is None  # the draft trained with plain RoPE
    if ht == H:
        assert "target_hidden_size" not in config
    else:
        assert config["target_hidden_size"] == ht

    tensors = load_file(out / "model.safetensors")
    want_shapes = serving_shapes(ht)
    assert set(tensors) == set(want_shapes)  # exactly these names; no embed_tokens.weight
    for name, shape in want_shapes.items():
        assert tuple(tensors[name].shape) == shape, name
    assert tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    sd = draft.state_dict()
    for name, t in tensors.items():
        if name not in ("d2t", "t2d"):
            assert t.dtype == torch.float32, name
        assert torch.equal(t, sd[name]), name
    # the maps are consistent: t2d marks exactly the target ids the draft tokens map to
    used = torch.arange(VD) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), used)


def test_export_bf16_keeps_vocab_maps_integer(tmp_path):
    draft = make_draft(seed=3)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, dtype=torch.bfloat16, capture_points=POINTS)
    tensors = load_file(out / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["fc.weight"], draft.fc.weight.detach().to(torch.bfloat16))
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], draft.d2t)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"], draft.t2d)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---------------------------------------------------------------------------- 2. round trip
def _ttt_logits(draft: Eagle3Draft, aux, ids_per_step, K: int) -> list[torch.Tensor]:
    B, T = ids_per_step.shape[1:]
    cache: list = []
    out = []
    with torch.no_grad():
        hidden = draft.project(aux)
        for k in range(K):
            positions = torch.arange(T).expand(B, T) + k
            hidden, kv = draft.step(ids_per_step[k], hidden, positions, cache)
            cache.append(kv)
            out.append(draft.logits(hidden))
    return out


# (fc_norm, norm_output): plain EAGLE-3 (the default), each EAGLE-3.1 option alone, both (docs/EAGLE3.md §1.5)
VARIANTS = {"eagle3": (False, False), "fc_norm": (True, False), "norm_output": (False, True), "eagle3.1": (True, True)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ht", [H, 40], ids=["H_eq_Ht", "H_ne_Ht"])
def test_round_trip_gives_identical_logits(tmp_path, ht, variant):
    draft = make_draft(seed=4, target_hidden_size=ht, rope_theta=20000.0, **dict(zip(("fc_norm", "norm_output"),
                                                                                   VARIANTS[variant])))
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, capture_points=POINTS)
    embed = draft.embed_tokens.weight.detach().clone()  # what the server injects: the target's embedding
    loaded = load_exported_draft(out, embed)
    assert loaded.cfg == draft.cfg

    B, T, K = 2, 7, 4
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(B, T, 3 * ht, generator=g)
    ids = torch.randint(0, V, (K, B, T), generator=g)
    ref = _ttt_logits(draft, aux, ids, K)
    got = _ttt_logits(loaded, aux, ids, K)
    for k in range(K):
        assert ref[k].shape == (B, T, VD)
        assert torch.equal(ref[k], got[k]), f"TTT step {k}"
    assert torch.equal(loaded.d2t, draft.d2t) and loaded.d2t.dtype == torch.int64
    assert torch.equal(loaded.t2d, draft.t2d) and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.embed_tokens.weight, embed)
    assert not loaded.embed_tokens.weight.requires_grad


# ------------------------------------------------------------------------------ 3. validation
def _edit_tensors(d: Path, fn) -> None:
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _edit_config(d: Path, fn) -> None:
    config = json.loads((d / "config.json").read_text())
    fn(config)
    (d / "config.json").write_text(json.dumps(config))


def _set(mapping, key, value):
    mapping[key] = value


def _not_increasing(t):
    d2t = t["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 map to the same target id
    t["d2t"] = d2t


def _out_of_range(t):
    d2t = t["d2t"].clone()
    d2t[-1] += V  # last draft id maps past the target vocab
    t["d2t"] = d2t


def _t2d_drop(t):
    t2d = t["t2d"].clone()
    t2d[int(torch.arange(VD)[0] + t["d2t"][0])] = False  # a draft token not marked in t2d
    t["t2d"] = t2d


def _t2d_extra(t):
    t2d = t["t2d"].clone()
    t2d[int((~t2d).nonzero()[0])] = True  # a non-draft target token marked in t2d
    t["t2d"] = t2d


FAULTS = {
    "wrong_shape": (lambda d: _edit_tensors(d, lambda t: _set(t, "midlayer.mlp.up_proj.weight", torch.zeros(I + 1, H))),
                    r"midlayer\.mlp\.up_proj\.weight has shape \(49, 32\), expected \(48, 32\)"),
    "wrong_shape_lm_head": (lambda d: _edit_tensors(d, lambda t: _set(t, "lm_head.weight", torch.zeros(VD, H + 1))),
                            r"lm_head\.weight has shape"),
    "missing_tensor": (lambda d: _edit_tensors(d, lambda t: t.pop("midlayer.hidden_norm.weight")),
                       r"missing tensor midlayer\.hidden_norm\.weight"),
    "missing_d2t": (lambda d: _edit_tensors(d, lambda t: t.pop("d2t")), r"missing tensor d2t"),
    "extra_embedding": (lambda d: _edit_tensors(d, lambda t: _set(t, "embed_tokens.weight", torch.zeros(V, H))),
                        r"unexpected tensor embed_tokens\.weight"),
    "wrong_architectures": (lambda d: _edit_config(d, lambda c: _set(c, "architectures", ["LlamaForCausalLM"])),
                            r"config\.architectures"),
    "wrong_model_type": (lambda d: _edit_config(d, lambda c: _set(c, "model_type", "deepseek_v3")),
                         r"config\.model_type"),
    "tied_embeddings": (lambda d: _edit_config(d, lambda c: _set(c, "tie_word_embeddings", True)),
                        r"config\.tie_word_embeddings"),
    "eagle_ids_two": (lambda d: _edit_config(d, lambda c: _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [1, 29])),
                      r"eagle_aux_hidden_state_layer_ids.*need 3 ints"),
    "eagle_ids_four": (lambda d: _edit_config(d, lambda c: _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [1, 2, 3, 4])),
                       r"eagle_aux_hidden_state_layer_ids.*need 3 ints"),
    "eagle_ids_str": (lambda d: _edit_config(d, lambda c: _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [1, "29", 57])),
                      r"eagle_aux_hidden_state_layer_ids.*need 3 ints"),
    "eagle_ids_float": (lambda d: _edit_config(d, lambda c: _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [1.0, 29, 57])),
                        r"eagle_aux_hidden_state_layer_ids.*need 3 ints"),
    "eagle_config_missing": (lambda d: _edit_config(d, lambda c: c.pop("eagle_config")),
                             r"eagle_aux_hidden_state_layer_ids.*need 3 ints"),
    "vllm_ids_two": (lambda d: _edit_config(d, lambda c: _set(c, "eagle_aux_hidden_state_layer_ids", [2, 30])),
                     r"eagle_aux_hidden_state_layer_ids=\[2, 30\]: need 3 ints \(vLLM"),
    "vllm_nested_missing": (lambda d: _edit_config(d, lambda c: c["eagle_config"].pop("layer_ids")),
                            r"eagle_config\.layer_ids=None differs"),
    "vllm_ids_other_layers": (lambda d: _edit_config(d, lambda c: (_set(c, "eagle_aux_hidden_state_layer_ids", [3, 31, 59]),
                                                                   _set(c["eagle_config"], "layer_ids", [3, 31, 59]))),
                              r"vLLM ids \[3, 31, 59\] and SGLang ids \[1, 29, 57\] capture different layers"),
    "d2t_not_increasing": (lambda d: _edit_tensors(d, _not_increasing), r"d2t does not map draft ids to strictly increasing"),
    "d2t_out_of_range": (lambda d: _edit_tensors(d, _out_of_range), r"d2t does not map draft ids to strictly increasing"),
    "t2d_missing_draft_token": (lambda d: _edit_tensors(d, _t2d_drop), r"t2d disagrees with d2t"),
    "t2d_extra_token": (lambda d: _edit_tensors(d, _t2d_extra), r"t2d disagrees with d2t"),
}


def test_validate_accepts_fresh_export(exported):
    validate_export(exported[1])  # no exception


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_validate_rejects_fault(exported, fault):
    _, out = exported
    make_fault, message = FAULTS[fault]
    make_fault(out)
    with pytest.raises(ValueError, match=message):
        validate_export(out)
    with pytest.raises(ValueError, match=message):  # loading refuses it too
        load_exported_draft(out, torch.zeros(V, H))


def test_validate_lists_every_problem(exported):
    _, out = exported
    FAULTS["missing_tensor"][0](out)
    FAULTS["wrong_architectures"][0](out)
    FAULTS["extra_embedding"][0](out)
    with pytest.raises(ValueError) as info:  # the method's own check: past the architecture
        get_method("eagle3").validate_export(out)
    msg = str(info.value)
    assert "missing tensor midlayer.hidden_norm.weight" in msg
    assert "config.architectures" in msg
    assert "unexpected tensor embed_tokens.weight" in msg


def test_validate_rejects_d2t_of_wrong_length(exported):
    _, out = exported
    _edit_tensors(out, lambda t: _set(t, "d2t", torch.cat([t["d2t"], t["d2t"][-1:]])))
    with pytest.raises(ValueError, match=r"d2t is \(51,\) torch.int64, expected \(50,\) torch.int64"):
        validate_export(out)


def test_validate_rejects_config_missing_size_field(exported):
    _, out = exported
    _edit_config(out, lambda c: c.pop("head_dim"))
    with pytest.raises(ValueError, match="head_dim"):
        validate_export(out)


# ------------------------------------------------------------------------------ 4. replacement
def test_export_twice_replaces_folder(tmp_path):
    first, second = make_draft(seed=6), make_draft(seed=7)
    target = tmp_path / "export"
    export_draft(first, target, LAYER_IDS, BOS, EOS, capture_points=POINTS)
    (target / "stale.txt").write_text("left by an earlier run")
    out = export_draft(second, target, [2, 30, 58], 1, 2, capture_points=[2, 30, 58])
    assert out == target
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(target / "model.safetensors")
    sd = second.state_dict()
    for name, t in tensors.items():
        assert torch.equal(t, sd[name]), name
    assert not torch.equal(tensors["fc.weight"], first.fc.weight.detach())
    config = json.loads((target / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .tmp sibling left behind


def test_failed_export_keeps_previous_export(tmp_path):
    good = make_draft(seed=8)
    target = tmp_path / "export"
    export_draft(good, target, LAYER_IDS, BOS, EOS, capture_points=POINTS)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ValueError, match="need 3 ints"):
        # invalid: refused before touching target
        export_draft(make_draft(seed=9), target, [1, 2], BOS, EOS, capture_points=[2, 3])
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    validate_export(target)
    # a later good export still succeeds and leaves only the final folder
    export_draft(good, target, LAYER_IDS, BOS, EOS, capture_points=POINTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.fixture
def umask():
    """Sets the process umask for one test (restored after it)."""
    import os

    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_export_files_get_the_umask_mode(tmp_path, umask, mask, mode):
    """A server running as another user (a container, a shared model store) reads the export:
    the weights get the same mode as the config, the one the umask gives any new file (a
    temporary file renamed into place would be 0600)."""
    umask(mask)
    out = export_draft(make_draft(seed=3), tmp_path / "export", LAYER_IDS, BOS, EOS, capture_points=POINTS)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"config.json": mode,
                                                                          "model.safetensors": mode}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# ------------------------------------------------------------------------------ 5. SGLang's and vLLM's ids
# What each server captures for an id, written out by hand from its source, independently of
# target_engine/layers.py. "input of layer k" = the residual stream entering decoder layer k.
def sglang_captures(family: str, ids: list[int]) -> list[int]:
    """SGLang 0.5.23 `set_eagle3_layers_to_capture`: Llama takes the input of layer id+1;
    DeepseekV2/V3 (Kimi-K2.5 delegates to it) the input of layer id, all shifted by one when ids[0] == 1."""
    if family == "llama":
        return [i + 1 for i in ids]
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)


def vllm_captures(ids: list[int]) -> list[int]:
    """vLLM >= 0.18 (llama.py, deepseek_v2.py; kimi_k25.py delegates): the input of layer id, every family."""
    return list(ids)


# (target config.json, target.aux_layers = capture points, SGLang ids and vLLM ids worked out by hand)
LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 64, "vocab_size": V}
KIMI_CFG = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": V}}
DEEPSEEK_CFG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": V}
SERVER_CASES = {
    "llama": (LLAMA_CFG, "llama", [4, 11, 23], [3, 10, 22], [4, 11, 23]),
    "llama_first_layer": (LLAMA_CFG, "llama", [1, 2, 29], [0, 1, 28], [1, 2, 29]),
    "kimi": (KIMI_CFG, "deepseek", [5, 33, 57], [5, 33, 57], [5, 33, 57]),
    "deepseek": (DEEPSEEK_CFG, "deepseek", [2, 40, 60], [2, 40, 60], [2, 40, 60]),
}


@pytest.mark.parametrize("case", sorted(SERVER_CASES))
def test_export_tells_sglang_and_vllm_the_same_layers(tmp_path, case):
    from specforge_k25.target_engine.hf_config import read_target_info
    from specforge_k25.target_engine.layers import layer_id_rule, sglang_layer_ids, validate_capture_points

    target_config, family, aux_layers, sglang_by_hand, vllm_by_hand = SERVER_CASES[case]
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(target_config))
    info = read_target_info(tmp_path / "target")
    points = validate_capture_points(aux_layers, info.num_layers)  # as train.loop.prepare does
    eagle_ids = sglang_layer_ids(points, layer_id_rule(info.architecture))
    out = export_draft(make_draft(), tmp_path / "export", eagle_ids, BOS, EOS, capture_points=points)

    config = json.loads((out / "config.json").read_text())
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # SGLang reads only this one
    vllm_ids = config["eagle_aux_hidden_state_layer_ids"]  # vLLM 0.16+ reads this first
    assert sglang_ids == sglang_by_hand
    assert vllm_ids == vllm_by_hand and config["eagle_config"]["layer_ids"] == vllm_by_hand
    assert sglang_captures(family, sglang_ids) == vllm_captures(vllm_ids) == aux_layers
    assert points != [2, info.num_layers // 2, info.num_layers - 3]  # vLLM's default would not do


def _tiny_hf(family: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1)).eval()


@pytest.mark.parametrize("family,points", [("llama", [1, 3, 5]), ("deepseek", [2, 3, 5])])
def test_both_servers_ids_select_the_tensors_training_used(tmp_path, family, points):
    """On a real (tiny, random) HF model: the stream entering layer k, which both servers capture
    for the ids the export writes, is the tensor the HF reference trains on (hidden_states[p])."""
    model = _tiny_hf(family)
    entering = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kwargs, k=k: entering.__setitem__(k, (
        args[0] if args else kwargs["hidden_states"]).clone()), with_kwargs=True)
             for k, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        out = model(torch.randint(0, 64, (1, 7)), output_hidden_states=True)
    for h in hooks:
        h.remove()
    rule = {"llama": "llama", "deepseek": "deepseek"}[family]
    from specforge_k25.target_engine.layers import sglang_layer_ids

    export = export_draft(make_draft(), tmp_path / "export", sglang_layer_ids(points, rule), BOS, EOS,
                          capture_points=points)
    config = json.loads((export / "config.json").read_text())
    by_sglang = [entering[k] for k in sglang_captures(family, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])]
    by_vllm = [entering[k] for k in vllm_captures(config["eagle_aux_hidden_state_layer_ids"])]
    trained_on = [out.hidden_states[p] for p in points]
    for a, b, c in zip(by_sglang, by_vllm, trained_on):
        assert torch.equal(a, c) and torch.equal(b, c)

