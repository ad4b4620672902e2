"""The DFlash head's replay proposals (specforge_k25/draft/dflash/replay.py) against one
`draft_block` per root."""
from __future__ import annotations

import torch

from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.draft.dflash.replay import block_proposals


def test_block_proposals_equal_one_block_per_root():
    """The batched block replay (all roots in masked chunks) equals `draft_block` run per root, at
    several block sizes and chunkings; column t is the root x[t+1]'s proposals, as the chain's."""
    cfg = DFlashConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, target_hidden_size=32,
                       num_aux_hidden_states=2, block_size=4, mask_token_id=49)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    draft.attach_lm_head(torch.randn(50, 32))
    aux, ids = torch.randn(11, 64), torch.randint(0, 49, (11,))
    for block, chunk in ((3, 7), (4, 512), (6, 6)):
        got = block_proposals(draft, aux, ids, block, queries_per_chunk=chunk)
        draft.cfg.block_size = block
        with torch.no_grad():
            logits = torch.stack([draft.logits(draft.draft_block(aux[:r], ids[r])[1:]) for r in range(1, 11)], 1)
        # the batch and the single roots are GEMMs of other shapes (fp32 rounding ~1e-6): an argmax
        # is compared where its lead is above 1e-4
        top = logits.topk(2, -1).values
        clear = top[..., 0] - top[..., 1] > 1e-4
        assert got.shape == (block - 1, 11) and (got[:, 10] == -1).all() and clear.float().mean() > 0.9
        assert torch.equal(got[:, :10][clear], logits.argmax(-1)[clear])
    # a root sees only the context before it: later states do not change its block
    changed = aux.clone()
    changed[6:] = torch.randn(5, 64)
    assert torch.equal(block_proposals(draft, changed, ids, 6)[:, :5], block_proposals(draft, aux, ids, 6)[:, :5])
