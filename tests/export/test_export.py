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

from specforge_k25.draft.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.export.serving import export_draft, load_exported_draft, validate_export

H, I, NH, NKV, HD, V, VD = 32, 48, 4, 2, 8, 300, 50
LAYER_IDS = [1, 29, 57]
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
               rms_norm_eps: float = 1e-6, max_pos: int = 4096) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                      head_dim=HD, vocab_size=V, draft_vocab_size=VD, target_hidden_size=target_hidden_size,
                      rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, max_position_embeddings=max_pos)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
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
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS)
    return draft, out


# ------------------------------------------------------------------------------ 1. contents
@pytest.mark.parametrize("ht", [H, 48], ids=["H_eq_Ht", "H_ne_Ht"])
def test_export_config_and_tensors_match_serving_format(tmp_path, ht):
    draft = make_draft(seed=2, target_hidden_size=ht, rope_theta=50000.0, rms_norm_eps=1e-5, max_pos=8192)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS)
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
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS, "use_aux_hidden_state": True},
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
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, dtype=torch.bfloat16)
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


@pytest.mark.parametrize("ht", [H, 40], ids=["H_eq_Ht", "H_ne_Ht"])
def test_round_trip_gives_identical_logits(tmp_path, ht):
    draft = make_draft(seed=4, target_hidden_size=ht, rope_theta=20000.0)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS)
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
    with pytest.raises(ValueError) as info:
        validate_export(out)
    msg = str(info.value)
    assert "missing tensor midlayer.hidden_norm.weight" in msg
    assert "config.architectures" in msg
    assert "unexpected tensor embed_tokens.weight" in msg


def test_validate_rejects_d2t_of_wrong_length(exported):
    _, out = exported
    _edit_tensors(out, lambda t: _set(t, "d2t", torch.cat([t["d2t"], t["d2t"][-1:]])))
    with pytest.raises(ValueError, match=r"d2t has shape \(51,\), expected \(50,\)"):
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
    export_draft(first, target, LAYER_IDS, BOS, EOS)
    (target / "stale.txt").write_text("left by an earlier run")
    out = export_draft(second, target, [2, 30, 58], 1, 2)
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
    export_draft(good, target, LAYER_IDS, BOS, EOS)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ValueError, match="need 3 ints"):
        export_draft(make_draft(seed=9), target, [1, 2], BOS, EOS)  # invalid: refused before touching target
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    validate_export(target)
    # a later good export still succeeds and leaves only the final folder
    export_draft(good, target, LAYER_IDS, BOS, EOS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
