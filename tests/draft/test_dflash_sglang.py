"""SGLang 0.5.23's own DFlashDraftModel, loaded from our export by SGLang's loader and run as its DFLASH
worker drafts (context K/V written by the worker's own code, one TARGET_VERIFY block forward over the
torch_native backend; tests/fixtures/sglang_dflash_probe.py), equals our DFlashDraft in fp32 within
1e-5 relative: behind SmolLM2 (H 576, 3 aux states) and the tiny DeepSeek-V3 (H 128, 2 aux states),
two requests of different context lengths each. Planted: a causal block, a block at positions from 0,
context that includes the anchor's own state: each is far from SGLang's numbers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge_k25.draft.dflash.method import DFlashMethod
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.draft.export_folder import publish_folder

ROOT = Path(__file__).resolve().parents[2]
# one KV pool serves both drafts in the probe: same layers, KV heads and head dim
BEHIND = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, intermediate_size=128, num_aux_hidden_states=3,
                    rope_theta=100000.0),
    "tiny_deepseek": dict(hidden_size=128, num_attention_heads=6, intermediate_size=96, num_aux_hidden_states=2,
                          rope_theta=50000.0),
}
CONTEXTS = [9, 5]


def _random_draft(sizes: dict, embed: torch.Tensor, seed: int) -> DFlashDraft:
    V = embed.shape[0]
    cfg = DFlashConfig(**sizes, num_hidden_layers=2, num_key_value_heads=3, head_dim=64, vocab_size=V,
                       target_hidden_size=sizes["hidden_size"], block_size=4, mask_token_id=V - 1,
                       max_position_embeddings=2048)
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):  # not ones: a norm SGLang failed to load or apply would show
                p.copy_(1 + 0.2 * torch.randn_like(p))
        draft.embed_tokens.weight.copy_(embed)
    return draft


@pytest.fixture(scope="module")
def sglang_runs(smollm2_path, tiny_deepseek_path, tmp_path_factory):
    from specforge_k25.target_engine.hf_config import load_embedding_and_head

    method, root, cases = DFlashMethod(), tmp_path_factory.mktemp("dflash_sglang"), {}
    for seed, (name, path) in enumerate((("smollm2", smollm2_path), ("tiny_deepseek", tiny_deepseek_path))):
        embed, head = load_embedding_and_head(path)
        draft = _random_draft(BEHIND[name], embed.float(), seed)
        draft.attach_lm_head(head.float())
        K = draft.cfg.num_aux_hidden_states
        config = method.serving_config(draft.cfg, sglang_layer_ids=[], vllm_layer_ids=[1, 3, 5][:K], bos_token_id=1,
                                       eos_token_id=2, dtype="float32")
        publish_folder(root / name / "export", method.serving_tensors(draft, torch.float32), config,
                       method.validate_export)
        g = torch.Generator().manual_seed(100 + seed)
        aux = [torch.randn(n, K * draft.cfg.hidden_size, generator=g) for n in CONTEXTS]
        last = [int(torch.randint(0, draft.cfg.vocab_size - 1, (1,), generator=g)) for _ in CONTEXTS]
        torch.save({"embed": draft.embed_tokens.weight.detach(), "aux": aux, "last": last}, root / name / "inputs.pt")
        cases[name] = (draft.eval(), aux, last)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "sglang_dflash_probe.py"), smollm2_path,
                          *[str(root / name) for name in cases]], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return {name: (*cases[name], torch.load(root / name / "sglang.pt", weights_only=False)) for name in cases}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ours(draft, aux, last, *, context_one_short=False, positions_from_zero=False, anchor_in_context=False):
    """Our block (the block attention, as draft_block runs it); the keyword arguments plant one bug each."""
    p, B = aux.shape[0], draft.cfg.block_size
    ids = torch.full((1, B), draft.cfg.mask_token_id)
    ids[0, 0] = last
    if anchor_in_context:  # the anchor's own target state joins the context (one more context token)
        aux = torch.cat([aux, aux[-1:]])
        p += 1
    start = 0 if positions_from_zero else aux.shape[0] - int(anchor_in_context)
    args = (aux[None], torch.arange(p)[None], ids, torch.arange(start, start + B)[None])
    with torch.no_grad():
        # context_one_short: the block misses the newest committed token's state
        return draft(*args, prefix=torch.tensor([[p - int(context_one_short)]]))[0]


@pytest.mark.engine
@pytest.mark.parametrize("behind", list(BEHIND))
def test_sglang_dflash_draft_equals_ours(sglang_runs, behind):
    draft, aux, last, record = sglang_runs[behind]
    cfg = draft.cfg
    assert record["class"] == "DFlashDraftModel" and record["attn_type"].endswith("ENCODER_ONLY")
    assert record["rope"][0] == cfg.rope_theta and record["block_size"] == cfg.block_size
    assert record["num_context_features"] == cfg.num_aux_hidden_states
    torch.testing.assert_close(record["ctx_hidden"], draft.project(torch.cat(aux)).detach(), rtol=1e-5, atol=1e-5)
    for i, (a, t) in enumerate(zip(aux, last)):
        theirs = record["hidden"][i]
        assert torch.equal(record["positions"][i], torch.arange(a.shape[0], a.shape[0] + cfg.block_size))
        assert _rel(_ours(draft, a, t), theirs) < 1e-5
        logits, their_logits = draft.logits(_ours(draft, a, t)), draft.logits(theirs)
        # two implementations agree to ~1e-5: an argmax is compared where SGLang's lead is above 1e-3
        top = their_logits.topk(2, -1).values
        clear = top[:, 0] - top[:, 1] > 1e-3
        assert _rel(logits, their_logits) < 1e-5 and clear.any()
        assert torch.equal(logits.argmax(-1)[clear], their_logits.argmax(-1)[clear])
        for bug in ("context_one_short", "positions_from_zero", "anchor_in_context"):
            assert _rel(_ours(draft, a, t, **{bug: True}), theirs) > 1e-3, bug
