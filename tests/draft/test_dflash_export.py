"""DFlash export (draft/dflash/export.py) and method (draft/dflash/method.py): layer ids by hand-derived
cases, round trip, validation, config resolution, the registry entry and the plan's parameter count."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from specforge_k25.draft.dflash import export, plan
from specforge_k25.draft.dflash.config import DFlashSpec
from specforge_k25.draft.dflash.method import DFlashMethod
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.draft.export_folder import publish_folder
from specforge_k25.draft.registry import get_method, method_of, method_of_export

CFG = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=50, target_hidden_size=32, num_aux_hidden_states=3,
                   block_size=4, mask_token_id=49, rope_theta=1000.0)
METHOD = DFlashMethod()


def _export(tmp_path, draft, points=(1, 3, 5)):
    config = METHOD.serving_config(draft.cfg, sglang_layer_ids=[99, 99, 99], vllm_layer_ids=list(points),
                                   bos_token_id=1, eos_token_id=2, dtype="float32")
    return publish_folder(tmp_path / "export", METHOD.serving_tensors(draft, torch.float32), config, METHOD.validate_export)


@pytest.mark.parametrize("points, sglang, why", [
    ([1, 3, 5], [0, 2, 4], "point p = input of layer p = output of layer p-1: SGLang captures id+1"),
    ([2, 13, 25, 36, 48, 59], [1, 12, 24, 35, 47, 58], "z-lab's Kimi-K2.5 ids [1,12,24,35,47,58] are these points"),
])
def test_layer_ids_by_hand(tmp_path, points, sglang, why):
    cfg = DFlashConfig(**{**CFG.__dict__, "num_aux_hidden_states": len(points)})
    config = json.loads((_export(tmp_path, DFlashDraft(cfg), points) / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == sglang, why
    assert config["eagle_aux_hidden_state_layer_ids"] == list(points)  # vLLM: its ids are the points (it adds 1 to dflash's)


def test_export_round_trip_and_what_the_folder_holds(tmp_path):
    torch.manual_seed(0)
    draft = DFlashDraft(CFG)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    lm_head = torch.randn(CFG.vocab_size, CFG.hidden_size)
    draft.attach_lm_head(lm_head)
    out = _export(tmp_path, draft)
    assert method_of_export(out) is get_method("dflash") and method_of(draft) is get_method("dflash")
    from safetensors.torch import load_file
    names = set(load_file(out / "model.safetensors"))
    assert names == set(export.expected_shapes(CFG)) and not any("embed" in n or "lm_head" in n for n in names)
    config = AutoConfig.from_pretrained(out)  # what both servers do first
    assert (config.model_type, config.head_dim, config.num_hidden_layers) == ("qwen3", 8, 2)
    assert config.dflash_config == {"target_layer_ids": [0, 2, 4], "block_size": 4, "mask_token_id": 49}
    back = METHOD.load(out, draft.embed_tokens.weight, lm_head)
    aux = torch.randn(5, 3 * CFG.hidden_size)
    torch.testing.assert_close(back.draft_block(aux, 3), draft.draft_block(aux, 3), rtol=0, atol=0)


def test_validate_export_names_each_problem(tmp_path):
    out = _export(tmp_path, DFlashDraft(CFG))
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["dflash_config"]["target_layer_ids"]  # the off-by-one
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        export.validate_export(out)
    assert "eagle_aux_hidden_state_layer_ids" in str(err.value) and "layer_types" in str(err.value)
    with pytest.raises(ValueError, match="points >= 1"):
        export.sglang_target_layer_ids([0, 3])


def test_method_resolves_config_and_serving_args():
    target = SimpleNamespace(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                             vocab_size=1000, rms_norm_eps=1e-5, max_position_embeddings=2048)
    spec = DFlashSpec(rope_theta=5e5)
    cfg = METHOD.resolve_config(spec, target, 5)
    assert (cfg.num_hidden_layers, cfg.num_aux_hidden_states, cfg.block_size, cfg.mask_token_id, cfg.head_dim) == \
        (5, 5, 8, 999, 8)
    assert cfg.draft_vocab_size == 1000 and cfg.loss_gamma == 4.0 and cfg.rope_theta == 5e5
    cfg = METHOD.resolve_config(replace(spec, block_size=16, num_layers=2, mask_token_id=7), target, 3)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id, cfg.loss_gamma) == (2, 16, 7, 7.0)
    (serving,) = METHOD.servings([[3, 4, 16], [15, 1, 16]])  # one block per distinct num_draft_tokens
    assert (serving.label, serving.draft_tokens, serving.depth) == ("block 16", 16, 15)
    assert serving.sglang_args == {"speculative_algorithm": "DFLASH", "speculative_num_steps": 1,
                                   "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 16}
    assert serving.vllm_speculative_config == {"method": "dflash", "num_speculative_tokens": 15}  # vLLM: B - 1
    draft = METHOD.build(cfg)
    assert METHOD.num_aux(cfg) == 3 and all(draft.get_submodule(u) is not None for u in METHOD.fsdp_units(draft))
    counts = plan.param_counts(cfg)
    trainable = sum(n for k, n in counts.items() if not k.endswith("(frozen)"))
    assert trainable == sum(p.numel() for p in draft.trainable_parameters())
    with pytest.raises(ValueError, match="block_size - 1"):
        METHOD.loss(draft, None, spec, depth=7)
