"""The eos an export writes (issue 19, item 4): Kimi-K2.5's config says [EOS] 163585, but a served
turn ends with `<|im_end|>` 163586 (target.end_of_turn_token), the token the server stops at.
`export_draft(..., end_of_turn_id=...)` writes the end-of-turn id first; without it the config's
eos is written as before."""
from __future__ import annotations

import json

import torch

from specforge_k25.config import compose_job
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.export.serving import export_draft, served_eos

EOS, IM_END = 163585, 163586


def test_served_eos():
    assert served_eos(EOS, IM_END) == [IM_END, EOS]
    assert served_eos([EOS, IM_END], IM_END) == [IM_END, EOS]
    assert served_eos([EOS, 7], IM_END) == [IM_END, EOS, 7]
    assert served_eos(IM_END, IM_END) == IM_END and served_eos(None, IM_END) == IM_END
    assert served_eos(EOS) == EOS and served_eos([1, 2]) == [1, 2]  # no end-of-turn token: as given


def test_kimi_export_writes_the_end_of_turn_token(tmp_path):
    from specforge_k25.data.kimi_tokenizer import build_kimi_local_tokenizer

    token = compose_job(["target=kimi_k25"]).target.end_of_turn_token
    assert token == "<|im_end|>" and build_kimi_local_tokenizer()._special_tokens[token] == IM_END
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=8, vocab_size=64, draft_vocab_size=16, target_hidden_size=16,
                                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128))
    d2t, t2d = build_vocab_maps(torch.randint(0, 1000, (64,)), 16)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    kimi = export_draft(draft, tmp_path / "kimi", [1, 29, 57], 163584, EOS, capture_points=[2, 30, 58],
                        end_of_turn_id=IM_END)
    assert json.loads((kimi / "config.json").read_text())["eos_token_id"] == [IM_END, EOS]
    plain = export_draft(draft, tmp_path / "plain", [1, 29, 57], 163584, EOS, capture_points=[2, 30, 58])
    assert json.loads((plain / "config.json").read_text())["eos_token_id"] == EOS
