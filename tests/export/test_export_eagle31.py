"""The EAGLE-3.1 options of the serving export (docs/EAGLE3.md §1.5, §5): with both off the folder
is byte for byte what it was before they existed; each on writes the keys and tensors SGLang 0.5.23
and vLLM (>= 0.22) read; validation; what vLLM's source reads of such a folder; and SGLang's own
draft class against ours on every variant.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.export.serving import export_draft, load_exported_draft, validate_export
from test_export import (BOS, EOS, HD, LAYER_IDS, NH, NKV, POINTS, VARIANTS, VD, H, I, V, _edit_config, _edit_tensors,
                         _set, make_draft, serving_shapes)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _exact_draft(**options) -> Eagle3Draft:
    """A draft whose every value is fixed without any RNG or kernel choice, so its export's bytes can
    be pinned: dyadic steps (exact) divided by 7 (an IEEE division: the same bits on every CPU;
    torch.linspace's values depend on ATEN_CPU_CAPABILITY)."""
    cfg = DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, **options)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for i, (_, p) in enumerate(draft.named_parameters()):
            n = p.numel()
            p.copy_(((torch.arange(n) - n // 2).float() / 2 ** (n.bit_length() - 1)).view(p.shape) * (i + 1) / 7)
        used = torch.arange(VD) * 5
        draft.d2t.copy_(used - torch.arange(VD))
        draft.t2d.zero_()
        draft.t2d[used] = True
    return draft


# sha256 of the files the export wrote for `_exact_draft()` before the EAGLE-3.1 options existed
# (the parent of commit 95857b8 writes these, under ATEN_CPU_CAPABILITY=default and avx512 alike)
PLAIN_EXPORT_SHA256 = {
    torch.float32: {"config.json": "a051c930090128cba9e8e92a0a7a6c0a6807b285ec57ed27e0fe3e1ef4ee659e",
                    "model.safetensors": "fb6f45c6c1c54e17a9ee7413a833bea0cee7f4ff48dc2f53524ab81dd99f6967"},
    torch.bfloat16: {"config.json": "017384d528e57fa8f9d0bf5b2ddfd3b5d0365ea0de8d09eeb3523a402ca33c1a",
                     "model.safetensors": "39b7f69db11f71dd73a93c9f1f21684085a5bceb23775c8780af14b6e500517f"},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_off_export_is_byte_identical(tmp_path, dtype):
    import hashlib

    out = export_draft(_exact_draft(fc_norm=False, norm_output=False), tmp_path / "export", LAYER_IDS, BOS, EOS,
                       dtype, capture_points=POINTS)
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in out.iterdir()} == PLAIN_EXPORT_SHA256[dtype]


@pytest.mark.parametrize("variant", VARIANTS)
def test_options_export_their_keys_and_tensors(tmp_path, variant):
    """Each option on adds its top-level `true` and (fc_norm) its three norms [Ht]; nothing else of the
    folder changes. Off, neither key is written."""
    fc_norm, norm_output = VARIANTS[variant]
    ht = 40
    draft = make_draft(seed=5, target_hidden_size=ht, fc_norm=fc_norm, norm_output=norm_output)
    out = export_draft(draft, tmp_path / "export", LAYER_IDS, BOS, EOS, capture_points=POINTS)
    plain = export_draft(make_draft(seed=5, target_hidden_size=ht), tmp_path / "plain", LAYER_IDS, BOS, EOS,
                         capture_points=POINTS)
    config, plain_config = (json.loads((d / "config.json").read_text()) for d in (out, plain))
    options = {k: True for k, on in (("fc_norm", fc_norm), ("norm_output", norm_output)) if on}
    assert config == plain_config | options
    assert not {"use_aux_norm", "norm_before_fc", "norm_before_residual"} & set(config)  # other norms: not ours
    tensors = load_file(out / "model.safetensors")
    norms = {f"fc_norm.{i}.weight": (ht,) for i in range(3)} if fc_norm else {}
    assert {n: tuple(t.shape) for n, t in tensors.items()} == serving_shapes(ht) | norms
    for name, t in tensors.items():
        assert torch.equal(t, draft.state_dict()[name]), name


def _options_export(tmp_path) -> Path:
    return export_draft(make_draft(seed=6, fc_norm=True, norm_output=True), tmp_path / "export", LAYER_IDS, BOS, EOS,
                        capture_points=POINTS)


OPTION_FAULTS = {
    "fc_norm_key_dropped": (lambda d: _edit_config(d, lambda c: c.pop("fc_norm")),
                            r"unexpected tensor fc_norm\.0\.weight \(config\.fc_norm is off"),
    "fc_norm_tensor_missing": (lambda d: _edit_tensors(d, lambda t: t.pop("fc_norm.1.weight")),
                               r"missing tensor fc_norm\.1\.weight"),
    "fc_norm_wrong_width": (lambda d: _edit_tensors(d, lambda t: _set(t, "fc_norm.2.weight", torch.ones(3 * H))),
                            r"fc_norm\.2\.weight has shape \(96,\), expected \(32,\)"),
    "fc_norm_as_string": (lambda d: _edit_config(d, lambda c: _set(c, "fc_norm", "true")),
                          r"config\.fc_norm='true': must be true or false"),
    "norm_output_as_int": (lambda d: _edit_config(d, lambda c: _set(c, "norm_output", 1)),
                           r"config\.norm_output=1: must be true or false"),
    "legacy_key_only": (lambda d: _edit_config(d, lambda c: (c.pop("fc_norm"), _set(c, "use_aux_norm", True))),
                        r"use_aux_norm without config\.fc_norm: SGLang applies fc_norm, vLLM does not"),
}


@pytest.mark.parametrize("fault", sorted(OPTION_FAULTS))
def test_validate_rejects_option_fault(tmp_path, fault):
    out = _options_export(tmp_path)
    validate_export(out)
    make_fault, message = OPTION_FAULTS[fault]
    make_fault(out)
    with pytest.raises(ValueError, match=message):
        load_exported_draft(out, torch.zeros(V, H))


# What vLLM reads of an EAGLE-3 draft folder, written out by hand from vLLM's source, independently
# of export/serving.py: vllm/model_executor/models/llama_eagle3.py as of vLLM 0.22.0 (EAGLE-3.1 came
# with vLLM PR #42764; deepseek_eagle3.py, the MLA draft, reads the same keys and norm names).
#   LlamaModel.__init__   fc_norm: getattr(config, "fc_norm", False) -> ModuleList of num_aux
#                         RMSNorm(target_hidden_size); num_aux = len(eagle_config
#                         ["eagle_aux_hidden_state_layer_ids"]) (else 3); norm_output:
#                         getattr(config, "norm_output", False). Top-level attributes of the draft's
#                         HF config, i.e. top-level config.json keys (its EAGLEConfig copies them).
#                         No `use_aux_norm` fallback (SGLang 0.5.23 has one).
#   load_weights          "t2d" skipped; "d2t" -> draft_id_to_target_id; lm_head.* as is; every other
#                         name gets "model."; then "midlayer." -> "layers.0.", q/k/v_proj -> qkv_proj,
#                         gate/up_proj -> gate_up_proj.
#   combine_hidden_states fc_norm[i] on the i-th of num_aux equal chunks, then fc.
#   LlamaModel.forward    returns (norm(h), norm(h) if norm_output else h): logits from the first,
#                         the next draft step reads the second.
VLLM_OPTION_KEYS = ("fc_norm", "norm_output")
VLLM_PLAIN_PARAMS = {
    "model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
}  # model.embed_tokens.weight is skipped when the folder has none (the target's is shared)
VLLM_FC_NORM_PARAM = "model.fc_norm.{}.weight"


def vllm_reads(config: dict, tensor_names) -> dict:
    """The options vLLM builds the draft with and the parameters the folder's tensors land in."""
    options = {key: bool(config.get(key, False)) for key in VLLM_OPTION_KEYS}
    num_aux = len(config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or [0] * 3)
    params = VLLM_PLAIN_PARAMS | ({VLLM_FC_NORM_PARAM.format(i) for i in range(num_aux)} if options["fc_norm"] else set())
    loaded = set()
    for name in tensor_names:
        if "t2d" in name:
            continue
        name = ("draft_id_to_target_id" if "d2t" in name else name if "lm_head" in name else "model." + name)
        name = name.replace("midlayer.", "layers.0.")
        for shard, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                             (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            name = name.replace(shard, fused)
        loaded.add(name)
    return {**options, "num_aux": num_aux, "params": params, "loaded": loaded}


@pytest.mark.parametrize("variant", VARIANTS)
def test_vllm_reads_the_options_and_every_tensor(tmp_path, variant):
    fc_norm, norm_output = VARIANTS[variant]
    out = export_draft(make_draft(seed=7, fc_norm=fc_norm, norm_output=norm_output), tmp_path / "export", LAYER_IDS,
                       BOS, EOS, capture_points=POINTS)
    seen = vllm_reads(json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors"))
    assert (seen["fc_norm"], seen["norm_output"]) == (fc_norm, norm_output)
    assert seen["loaded"] == seen["params"]  # every parameter filled, no tensor without a parameter
    if fc_norm:
        assert seen["num_aux"] == 3


@pytest.mark.slow
def test_sglang_draft_class_runs_each_variant_as_ours(tmp_path):
    """SGLang 0.5.23's LlamaForCausalLMEagle3, built from each variant's export by its own config and
    load_weights, through a 3-step draft chain (tests/fixtures/sglang_eagle3_steps.py; no engine):
    the state its logits come from and the state it hands the next step equal ours, fp32, 1e-5
    relative; norm_output hands on the very state the logits come from."""
    import os
    import subprocess
    import sys

    T, K = 6, 3
    g = torch.Generator().manual_seed(8)
    scale = torch.tensor([0.2, 1.0, 5.0]).repeat_interleave(H)  # aux states of different scales
    inputs = {"aux": torch.randn(T, 3 * H, generator=g) * scale, "ids": torch.randint(0, V, (K, T), generator=g),
              "embed": torch.randn(V, H, generator=g)}
    torch.save(inputs, tmp_path / "inputs.pt")
    exports = {}
    for variant, (fc_norm, norm_output) in VARIANTS.items():
        draft = make_draft(seed=9, fc_norm=fc_norm, norm_output=norm_output)
        exports[variant] = export_draft(draft, tmp_path / variant, LAYER_IDS, BOS, EOS, capture_points=POINTS)
    script = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_eagle3_steps.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"),
                           *map(str, exports.values())], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sglang = torch.load(tmp_path / "out.pt")

    def close(ours, theirs, what):
        err = (ours - theirs).abs().max().item()
        assert err <= 1e-5 * theirs.abs().max().item(), f"{what}: max |ours - SGLang| = {err:.3g}"

    for variant, (fc_norm, norm_output) in VARIANTS.items():
        got = sglang[str(exports[variant])]
        assert got["norm_output"] == norm_output and (got["fc_norm"] is not None) == fc_norm, variant
        ours = load_exported_draft(exports[variant], inputs["embed"]).eval()
        with torch.no_grad():
            hidden, cache = ours.project(inputs["aux"][None]), []
            for k, step in enumerate(got["steps"]):
                hidden, kv = ours.step(inputs["ids"][k][None], hidden, (torch.arange(T) + k)[None], cache)
                cache.append(kv)
                close(hidden[0] if norm_output else ours.norm(hidden)[0], step["to_logits"], f"{variant} step {k} logits input")
                close(hidden[0], step["aux_out"], f"{variant} step {k} hidden handed on")
                close(ours.logits(hidden)[0], step["to_logits"] @ got["lm_head"].T, f"{variant} step {k} logits")
                assert torch.equal(step["aux_out"], step["to_logits"]) == norm_output, (variant, k)
