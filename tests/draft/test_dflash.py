"""DFlash drafter and block loss (specforge_k25/draft/dflash): equal to the float64 anchor-by-anchor
reference (tests/fixtures/dflash_reference.py) in loss, counters and every gradient; planted bugs in
the block mask and labels are caught; anchors come from the caller's generator (resume-exact)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from dflash_reference import block_loss, draft_hidden

import specforge_k25.draft.dflash.model as dflash_model
from specforge_k25.draft.dflash import loss as dl
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft

CFG = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=50, target_hidden_size=32, num_aux_hidden_states=3,
                   block_size=4, mask_token_id=49, rope_theta=1000.0, num_anchors=5, loss_gamma=2.0, logits_chunk=5)


def make_case(cfg=CFG, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = DFlashDraft(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so a skipped norm shows
            p.add_(0.3 * torch.randn_like(p))
    model.attach_lm_head(0.3 * torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
    lengths = torch.tensor([13, 10])
    T = int(lengths.max())
    input_ids = torch.randint(0, cfg.vocab_size - 1, (2, T))
    loss_mask = torch.rand(2, T) < 0.85
    loss_mask[1, 10:] = False
    input_ids[1, 10:] = 0
    aux = torch.randn(2, T, cfg.num_aux_hidden_states * cfg.hidden_size, dtype=dtype)
    anchors, valid = dl.sample_anchors(loss_mask, lengths, cfg.num_anchors, torch.Generator().manual_seed(seed))
    return model, aux, input_ids, loss_mask, lengths, anchors, valid


def reference(model, aux, input_ids, loss_mask, lengths, anchors, valid):
    weights = {k: v for k, v in model.named_parameters()} | {"embed_tokens.weight": model.embed_tokens.weight}
    return block_loss(weights, model.lm_head_weight, model.cfg, aux, input_ids, loss_mask, lengths, anchors, valid)


def test_loss_counters_and_grads_equal_the_float64_reference():
    case = make_case()
    model = case[0]
    ours = dl.dflash_loss(*case)
    ref = reference(*case)
    assert torch.equal(ours.counted, ref["counted"]) and int(ours.counted.sum()) > 10
    assert torch.equal(ours.correct, ref["correct"]) and torch.equal(ours.scored, ref["counted"])
    torch.testing.assert_close(ours.ploss, ref["ploss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.alpha_sum.double(), ref["alpha_sum"], rtol=1e-6, atol=1e-7)  # fp32 counter
    torch.testing.assert_close(ours.loss, ref["loss"], rtol=1e-10, atol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    g_ours = torch.autograd.grad(ours.loss, params)
    g_ref = torch.autograd.grad(ref["loss"], params)
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    assert torch.equal(dl.loss_positions(*case[3:7], CFG.block_size), ours.counted)
    # the normalizer replaces this batch's counts (data-parallel ranks pass the global ones)
    doubled = dl.dflash_loss(*case, normalizer=2 * ours.counted)
    torch.testing.assert_close(doubled.loss, ours.loss / 2, rtol=1e-12, atol=0)


def test_fp32_module_with_layer_checkpointing_is_within_1e5_of_the_reference():
    case64 = make_case()
    model = DFlashDraft(CFG)
    model.load_state_dict({k: v.float() for k, v in case64[0].state_dict().items()})
    model.attach_lm_head(case64[0].lm_head_weight.float())
    case32 = (model, case64[1].float(), *case64[2:])
    ours = dl.dflash_loss(*case32, checkpoint=True)
    torch.testing.assert_close(ours.loss.double(), reference(*case64)["loss"], rtol=1e-5, atol=0)
    ours.loss.backward()
    assert model.fc.weight.grad is not None and model.embed_tokens.weight.grad is None


def test_draft_block_is_the_servers_block():
    """One block after a prefix (what SGLang drafts) equals the reference's single block."""
    model, aux = make_case()[:2]
    ours = model.draft_block(aux[0, :6], last_token=7)
    weights = dict(model.named_parameters()) | {"embed_tokens.weight": model.embed_tokens.weight}
    ids = torch.tensor([7] + [CFG.mask_token_id] * (CFG.block_size - 1))
    ref = draft_hidden(weights, CFG, aux[0, :6], torch.arange(6), ids, torch.arange(6, 6 + CFG.block_size))
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def _mutated(monkeypatch, change):
    original = dl.block_inputs

    def mutated(*args, **kwargs):
        return change(original(*args, **kwargs))

    monkeypatch.setattr(dl, "block_inputs", mutated)


def _causal_block(monkeypatch):
    """Block tokens see only the block tokens up to themselves (the attention swapped for a dense
    one whose own-block part is lower-triangular)."""
    def causal(q, k_ctx, v_ctx, k_blk, v_blk, prefix, scale, tiling):
        B, nh, Q, _ = q.shape
        T, g, Bk = k_ctx.shape[2], nh // k_ctx.shape[1], tiling.block_size
        owner = torch.arange(Q) // Bk
        ctx_visible = torch.arange(T) < prefix[:, owner, None]  # [B, Q, T]
        own = ((owner[:, None] == owner[None]) & torch.ones(Q, Q, dtype=torch.bool).tril()).expand(B, -1, -1)
        keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(g, 1)
        values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(g, 1)
        mask = torch.cat([ctx_visible, own], -1)[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    monkeypatch.setattr(dflash_model, "block_attention", causal)


def _label_off_by_one(monkeypatch):
    _mutated(monkeypatch, lambda inp: dataclasses.replace(inp, labels=torch.roll(inp.labels, -1, dims=1)))


def _context_includes_anchor(monkeypatch):
    """The block also sees the anchor's own target state (context <= a instead of < a)."""
    _mutated(monkeypatch, lambda inp: dataclasses.replace(inp, prefix=inp.prefix + (inp.prefix > 0)))


def _positions_from_zero(monkeypatch):
    _mutated(monkeypatch, lambda inp: dataclasses.replace(
        inp, block_positions=inp.offset.expand_as(inp.block_positions).clone()))


@pytest.fixture(scope="module")
def case_and_reference_loss():
    case = make_case()
    with torch.no_grad():
        return case, float(reference(*case)["loss"])


@pytest.mark.parametrize("plant", [_causal_block, _label_off_by_one, _context_includes_anchor, _positions_from_zero])
def test_planted_bugs_in_mask_labels_and_positions_are_caught(monkeypatch, case_and_reference_loss, plant):
    case, ref = case_and_reference_loss
    with torch.no_grad():
        assert abs(float(dl.dflash_loss(*case).loss) - ref) < 1e-10 * abs(ref)  # unplanted: equal
        plant(monkeypatch)
        assert abs(float(dl.dflash_loss(*case).loss) - ref) > 1e-3 * abs(ref)


def test_anchors_follow_the_rules_and_the_generator():
    _, _, _, loss_mask, lengths, _, _ = make_case()
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    a1, v1 = dl.sample_anchors(loss_mask, lengths, 3, g)
    a_next, _ = dl.sample_anchors(loss_mask, lengths, 3, g)
    g.set_state(state)  # a resume restores the saved state: the same anchors again
    a2, v2 = dl.sample_anchors(loss_mask, lengths, 3, g)
    assert torch.equal(a1, a2) and torch.equal(v1, v2) and not torch.equal(a1, a_next)
    for b, n in enumerate(lengths.tolist()):
        for a, ok in zip(a1[b].tolist(), v1[b].tolist()):
            if ok:
                assert 1 <= a <= n - 2 and bool(loss_mask[b, a + 1])
        picked = a1[b][v1[b]]
        assert torch.equal(picked, picked.sort().values) and picked.unique().numel() == picked.numel()
    many, valid = dl.sample_anchors(loss_mask, lengths, 100, g)  # fewer candidates than asked: all of them
    assert torch.equal(many[0][valid[0]], dl.anchor_candidates(loss_mask[0], 13))


def test_config_is_checked():
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDraft(dataclasses.replace(CFG, mask_token_id=50))
    with pytest.raises(ValueError, match="target hidden"):
        DFlashDraft(dataclasses.replace(CFG, target_hidden_size=64))
    with pytest.raises(RuntimeError, match="attach_lm_head"):
        DFlashDraft(CFG).logits(torch.zeros(1, CFG.hidden_size))
