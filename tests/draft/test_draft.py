"""Tests of the EAGLE-3 draft head: TTT loss/gradients, TTT attention mask, vocab maps, teacher.

The TTT reference (tests/fixtures/ttt_reference.py) is written directly from docs/EAGLE3.md §1 and
§3 as slow, explicit per-sequence / per-step / per-position loops. It reuses the draft's parameter
tensors (so autograd gives reference gradients) but none of the draft's forward code. The loss
tests run each EAGLE-3.1 variant of the draft (§1.5) too.
"""
from __future__ import annotations


import pytest
import torch

from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.objective import Teacher, compute_teacher, simulated_acceptance_length
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.eagle3.model import Attention, DraftConfig
from specforge_k25.draft.vocab import build_vocab_maps, count_tokens, draft_to_target, target_to_draft
from ttt_reference import _tiny_setup, reference_ttt  # tests/fixtures: the float64 loop reference

# (fc_norm, norm_output): plain EAGLE-3 (the default), each EAGLE-3.1 option alone, both
VARIANTS = {"eagle3": (False, False), "fc_norm": (True, False), "norm_output": (False, True), "eagle3.1": (True, True)}


def _option_matters(draft, teacher, batch, K, option):
    """The loss with `option` switched off on the same weights (fc_norm's norms then unused): the
    data must make the option change the loss clearly, or the reference tests would prove nothing."""
    import dataclasses

    on = ttt_loss(draft, *batch, teacher, ttt_length=K).loss.detach()
    saved, draft.cfg = draft.cfg, dataclasses.replace(draft.cfg, **{option: False})
    try:
        off = ttt_loss(draft, *batch, teacher, ttt_length=K).loss.detach()
    finally:
        draft.cfg = saved
    return float((on - off).abs() / off.abs())


@pytest.mark.parametrize("variant", VARIANTS)
def test_ttt_loss_and_grads_match_float64_reference(variant):
    K = 3
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = _tiny_setup(0, *VARIANTS[variant])
    teacher = compute_teacher(final, lm_head_full, d2t, chunk=5)  # chunk < B*T on purpose
    res = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K)
    res.loss.backward()
    params = dict(draft.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable  # frozen target embedding
    assert params["embed_tokens.weight"].grad is None
    got_grads = {n: p.grad.detach().clone() for n, p in trainable.items()}
    assert all(g is not None for g in got_grads.values())

    ref_loss, ref_ploss, ref_counted, ref_correct, ref_scored, ref_alpha = reference_ttt(
        draft, aux, input_ids, loss_mask, lengths, final, lm_head_full, d2t, K)
    ref_grads = torch.autograd.grad(ref_loss, list(trainable.values()))

    # The test data must exercise every rule: each step counts something, and some scored
    # positions are excluded because the target argmax is not a draft token.
    assert all(c > 0 for c in ref_counted), ref_counted
    assert sum(ref_scored) > sum(ref_counted)

    # Counts are exact integers.
    assert res.counted.tolist() == ref_counted
    assert res.scored.tolist() == ref_scored
    assert res.correct.tolist() == ref_correct

    # ttt_loss computes the log-softmax, the teacher and the loss in float32 by design
    # (Teacher is fp32; RMSNorm/attention softmax run in fp32), so float32-level tolerances.
    # Any semantic error (mask, RoPE position, shift, counting, norm) is O(1e-2..1) here.
    torch.testing.assert_close(res.loss.double(), ref_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(res.ploss.double(), torch.stack(ref_ploss).detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(res.alpha_sum.double(), torch.tensor(ref_alpha, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    for (name, g), rg in zip(got_grads.items(), ref_grads):
        scale = rg.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g, rg, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")
    assert ("fc_norm.0.weight" in trainable) == cfg.fc_norm  # the norms exist (and train) only when on
    for option in ("fc_norm", "norm_output"):
        if getattr(cfg, option):
            assert _option_matters(draft, teacher, (aux, input_ids, loss_mask, lengths), K, option) > 1e-2, option


@pytest.mark.parametrize("variant", VARIANTS)
def test_ttt_loss_float64_precision(variant):
    """Same as the reference test but with a float64 teacher built by hand and 1e-10 tolerances."""
    K = 3
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = _tiny_setup(0, *VARIANTS[variant])
    full = final @ lm_head_full.T
    used = torch.arange(cfg.draft_vocab_size) + d2t
    inv = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
    inv[used] = torch.arange(cfg.draft_vocab_size)
    teacher = Teacher(full[..., used], torch.logsumexp(full, -1), inv[full.argmax(-1)])
    res = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K)
    res.loss.backward()
    trainable = [p for p in draft.parameters() if p.requires_grad]
    ref_loss = reference_ttt(draft, aux, input_ids, loss_mask, lengths, final, lm_head_full, d2t, K)[0]
    ref_grads = torch.autograd.grad(ref_loss, trainable)
    assert res.loss.dtype == torch.float64
    torch.testing.assert_close(res.loss, ref_loss.detach(), rtol=1e-10, atol=0)
    for p, rg in zip(trainable, ref_grads):
        torch.testing.assert_close(p.grad, rg, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# TTT attention mask, hand-made case
# ----------------------------------------------------------------------------------------------

# Column order of the visible keys: (step 0, pos 0..2), (step 1, pos 0..2), (step 2, pos 0..2).
EXPECTED_VISIBILITY = {
    0: [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
    ],
    1: [
        [1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],
    ],
    2: [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ],
}


@pytest.mark.parametrize("bf16", [False, True])
def test_activation_checkpointing_gives_the_same_loss_and_grads(bf16):
    K = 4
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = _tiny_setup(3)
    draft = draft.float()
    teacher = compute_teacher(final.float(), lm_head_full.float(), d2t)
    results = []
    for checkpoint in (False, True):
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            res = ttt_loss(draft, aux.float(), input_ids, loss_mask, lengths, teacher, K, checkpoint=checkpoint)
        res.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
        results.append((res, grads))
    (a, ga), (b, gb) = results
    assert torch.equal(a.loss, b.loss)  # same forward, bit for bit
    for name in ("ploss", "counted", "correct", "scored", "alpha_sum"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for n in ga:  # backward recomputes the same ops on the same inputs (each step's own: a late-bound
        assert ga[n].abs().max() > 0, n  # closure over the loop's tensors was caught here, O(1) off)
        torch.testing.assert_close(gb[n], ga[n], rtol=0, atol=0, msg=n)


def test_teacher_with_a_bf16_lm_head_is_the_bf16_matmul():
    """A bf16 target's lm_head stays bf16 on the trainer: logits within bf16 rounding of the exact
    product of the bf16-rounded inputs (what the serving engine computes)."""
    torch.manual_seed(4)
    B, T, Ht, V, Vd = 2, 6, 64, 300, 40
    d2t, _ = build_vocab_maps(torch.randint(0, 50, (V,)), Vd)
    final = torch.randn(B, T, Ht)
    lm_head = torch.randn(V, Ht).bfloat16()
    got = compute_teacher(final, lm_head, d2t, chunk=5)
    exact = final.bfloat16().double() @ lm_head.double().T  # [B, T, V]
    used = draft_to_target(d2t)
    assert got.draft_logits.dtype == torch.float32
    err = (got.draft_logits.double() - exact[..., used]).abs()
    assert (err <= exact[..., used].abs() * 2**-8 + 1e-6).all()  # one bf16 rounding of the output
    assert err.max() > 0  # really rounded: not an fp32 product
    torch.testing.assert_close(got.logsumexp.double(), torch.logsumexp(exact, -1), rtol=2**-8, atol=0)


def test_ttt_attention_visibility_hand_case():
    T, hd = 3, 10  # 9 (step, position) slots + 1 unused value dim
    cfg = DraftConfig(hidden_size=20, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=hd, vocab_size=8, draft_vocab_size=4, target_hidden_size=20)
    attn = Attention(cfg).double()
    B = 2
    x = torch.zeros(B, T, 2 * cfg.hidden_size, dtype=torch.float64)
    for t in range(T):
        x[:, t, t] = 1.0  # input dim t marks position t
    torch.manual_seed(0)
    with torch.no_grad():
        attn.q_proj.weight.zero_()  # q = 0 -> every visible key gets the same score
        attn.k_proj.weight.copy_(torch.randn_like(attn.k_proj.weight))  # keys irrelevant when q = 0
        attn.o_proj.weight.copy_(torch.eye(cfg.hidden_size, dtype=torch.float64))  # nh*hd == H
    cache: list = []
    for k in range(3):
        with torch.no_grad():
            attn.v_proj.weight.zero_()
            for t in range(T):
                attn.v_proj.weight[k * T + t, t] = 1.0  # value of (step k, pos t) = one-hot k*T+t
        positions = (torch.arange(T) + k).expand(B, T)
        out, kv = attn(x, positions, cache)  # [B, T, H] = both heads' outputs side by side
        cache.append(kv)
        vis = torch.tensor(EXPECTED_VISIBILITY[k], dtype=torch.float64)
        expected = torch.zeros(T, hd, dtype=torch.float64)
        expected[:, :9] = vis / vis.sum(-1, keepdim=True)
        for b in range(B):
            for h in range(cfg.num_attention_heads):
                torch.testing.assert_close(out[b, :, h * hd:(h + 1) * hd], expected, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Vocab maps
# ----------------------------------------------------------------------------------------------


def _check_maps_consistent(d2t, t2d, V, Vd):
    used = draft_to_target(d2t)
    assert t2d.dtype == torch.bool and t2d.shape == (V,)
    assert d2t.dtype == torch.int64 and d2t.shape == (Vd,)
    assert int(t2d.sum()) == Vd
    for i in range(Vd):
        assert int(used[i]) == i + int(d2t[i])  # target = i + d2t[i]
    inv = target_to_draft(d2t, V)
    for v in range(V):
        if bool(t2d[v]):
            assert int(used[int(inv[v])]) == v
        else:
            assert int(inv[v]) == -1
    assert torch.equal(inv >= 0, t2d)


@pytest.mark.parametrize(
    "counts, Vd, used, d2t",
    [
        # ties at count 5 (ids 1, 3: both in) and at count 3 (ids 2, 6: the lower id 2 wins)
        ([0, 5, 3, 5, 0, 7, 3, 0, 1, 0], 4, [1, 2, 3, 5], [1, 1, 1, 2]),
        # only 2 ids seen (3, 7): padded with the lowest unseen ids 0, 1
        ([0, 0, 0, 4, 0, 0, 0, 9, 0, 0], 4, [0, 1, 3, 7], [0, 0, 1, 4]),
        # seen ids 0 and 9: padding skips the already-used id 0
        ([2, 0, 0, 0, 0, 0, 0, 0, 0, 1], 4, [0, 1, 2, 9], [0, 0, 0, 6]),
        # Vd == V: everything
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 10, list(range(10)), [0] * 10),
    ],
)
def test_build_vocab_maps_hand_cases(counts, Vd, used, d2t):
    V = len(counts)
    got_d2t, got_t2d = build_vocab_maps(torch.tensor(counts, dtype=torch.int64), Vd)
    assert got_d2t.tolist() == d2t
    expected_t2d = [v in used for v in range(V)]
    assert got_t2d.tolist() == expected_t2d
    assert draft_to_target(got_d2t).tolist() == used
    _check_maps_consistent(got_d2t, got_t2d, V, Vd)


def test_build_vocab_maps_random_roundtrip():
    torch.manual_seed(1)
    V, Vd = 200, 37
    counts = torch.randint(0, 5, (V,))  # many ties
    d2t, t2d = build_vocab_maps(counts, Vd)
    _check_maps_consistent(d2t, t2d, V, Vd)
    used = draft_to_target(d2t)
    assert torch.all(used[1:] > used[:-1])  # ascending, distinct
    # Every kept id is at least as frequent as every dropped id.
    assert int(counts[t2d].min()) >= int(counts[~t2d].max())


def test_build_vocab_maps_rejects_too_large_draft_vocab():
    with pytest.raises(ValueError):
        build_vocab_maps(torch.zeros(5, dtype=torch.int64), 6)


def test_count_tokens_counts_only_loss_mask_tokens():
    s1 = Sample(input_ids=torch.tensor([1, 2, 2, 3, 9]), loss_mask=torch.tensor([False, True, True, False, True]))
    s2 = Sample(input_ids=torch.tensor([3, 3, 4]), loss_mask=torch.tensor([True, False, True]))
    s3 = Sample(input_ids=torch.tensor([5, 6]), loss_mask=torch.tensor([False, False]))  # nothing supervised
    counts = count_tokens([s1, s2, s3], vocab_size=10)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [0, 0, 2, 1, 1, 0, 0, 0, 0, 1]


def test_count_tokens_rejects_out_of_vocab_id():
    s = Sample(input_ids=torch.tensor([1, 10]), loss_mask=torch.tensor([True, True]))
    with pytest.raises(ValueError):
        count_tokens([s], vocab_size=10)


# ----------------------------------------------------------------------------------------------
# Teacher chunking
# ----------------------------------------------------------------------------------------------


def test_compute_teacher_chunking_matches_full_logits():
    torch.manual_seed(2)
    B, T, Ht, V, Vd = 2, 5, 12, 40, 15
    counts = torch.randint(0, 50, (V,))
    d2t, _ = build_vocab_maps(counts, Vd)
    # small integers: every logit exact whatever the chunk's GEMM shape (ties included), so the
    # logits and argmaxes agree bit for bit; the log-sum-exp of equal rows to fp32 rounding
    final = torch.randint(-3, 4, (B, T, Ht)).double()
    lm_head = torch.randint(-3, 4, (V, Ht)).double()

    teachers = [compute_teacher(final, lm_head, d2t, chunk=c) for c in (1, 7, 10_000)]
    for t in teachers[1:]:
        assert torch.equal(t.argmax_draft_id, teachers[0].argmax_draft_id)
        assert torch.equal(t.draft_logits, teachers[0].draft_logits)
        torch.testing.assert_close(t.logsumexp, teachers[0].logsumexp, rtol=2**-22, atol=0)

    # Direct computation from the full [B, T, V] logits.
    full = final @ lm_head.T
    used = (torch.arange(Vd) + d2t).tolist()
    exp_draft_logits = full[..., used]
    exp_lse = torch.logsumexp(full, -1)
    exp_arg = torch.full((B, T), -1, dtype=torch.int64)
    n_in = 0
    for b in range(B):
        for t in range(T):
            a = int(full[b, t].argmax())
            if a in used:
                exp_arg[b, t] = used.index(a)
                n_in += 1
    assert 0 < n_in < B * T  # both in- and out-of-draft-vocab argmaxes are exercised
    for t in teachers:
        assert t.draft_logits.shape == (B, T, Vd)
        assert torch.equal(t.argmax_draft_id, exp_arg)
        torch.testing.assert_close(t.draft_logits.double(), exp_draft_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t.logsumexp.double(), exp_lse, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Simulated acceptance length
# ----------------------------------------------------------------------------------------------


def test_simulated_acceptance_length_hand_cases():
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert simulated_acceptance_length(torch.tensor([0.5, 0.5])) == pytest.approx(1.75)
    assert simulated_acceptance_length([]) == pytest.approx(1.0)
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert simulated_acceptance_length([1.0, 0.0, 1.0]) == pytest.approx(2.0)  # chain stops at the miss


# ----------------------------------------------------------------------------------------------
# EAGLE-3.1 options off: today's draft, today's checkpoints
# ----------------------------------------------------------------------------------------------

PLAIN_STATE = ["d2t", "t2d", "embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight",
               "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
               "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
               "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
               "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_names_and_order(variant):
    """Off: exactly the names, in the order, checkpoints have always held (AdamW's state is indexed by
    parameter order). fc_norm adds its three norms [Ht]; norm_output adds nothing."""
    fc_norm, norm_output = VARIANTS[variant]
    draft = _tiny_setup(0, fc_norm, norm_output)[1]
    extra = ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"] if fc_norm else []
    assert list(draft.state_dict()) == PLAIN_STATE[:3] + extra + PLAIN_STATE[3:]
    assert all(draft.state_dict()[n].shape == (draft.cfg.target_hidden_size,) for n in extra)
    from specforge_k25.plan import trainable_params  # the memory plan counts the same parameters

    assert sum(p.numel() for p in draft.trainable_parameters()) == trainable_params(draft.cfg)


def test_checkpoints_from_before_the_options_still_resume():
    """A checkpoint's fingerprint holds the draft config; one written before fc_norm / norm_output
    existed (neither key) resumes a run with both off and is refused by a run with one on."""
    import dataclasses
    from pathlib import Path

    from specforge_k25.train.fingerprint import check_fingerprint

    cfg = _tiny_setup(0)[0]
    now = {"draft": dataclasses.asdict(cfg), "batch_size": 1, "trainer_ranks": 1}
    before = {**now, "draft": {k: v for k, v in now["draft"].items() if k not in ("fc_norm", "norm_output")}}
    check_fingerprint(before, now, Path("ckpt"))
    for option in ("fc_norm", "norm_output"):
        other = {**now, "draft": {**now["draft"], option: True}}
        with pytest.raises(ValueError, match=rf"draft: checkpoint .*'{option}': True"):
            check_fingerprint(before, other, Path("ckpt"))


@pytest.mark.parametrize("variant", ["llama", "mla"])
@pytest.mark.parametrize("on", [True, False])
def test_head_from_target_starts_the_draft_head_at_the_target_rows(variant, on):
    """draft.head_from_target: the draft's logits are the target's logits of the draft tokens,
    listed by hand for counts whose draft vocabulary is target ids 1, 2, 3, 5 (vocab-map hand case
    above); off, the seeded random init stays."""
    from specforge_k25.draft.eagle3.config import Eagle3Spec
    from specforge_k25.draft.eagle3_mla.config import Eagle3MLASpec
    from specforge_k25.draft.registry import method_of_spec
    from mla_ttt_reference import tiny_mla_config

    counts = torch.tensor([0, 5, 3, 5, 0, 7, 3, 0, 1, 0])
    spec = (Eagle3Spec if variant == "llama" else Eagle3MLASpec)(head_from_target=on)
    method = method_of_spec(spec)
    cfg = (DraftConfig(hidden_size=6, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=3,
                       vocab_size=10, draft_vocab_size=4, target_hidden_size=6) if variant == "llama"
           else tiny_mla_config(hidden_size=6, target_hidden_size=6, vocab_size=10, draft_vocab_size=4))
    torch.manual_seed(0)
    draft = method.build(cfg).double()
    before = draft.lm_head.weight.detach().clone()
    d2t, t2d = build_vocab_maps(counts, 4)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    head = torch.randn(10, 6, dtype=torch.float64)
    method.init_from_target(draft, spec, head)
    x = torch.randn(5, 6, dtype=torch.float64)
    if not on:
        assert torch.equal(draft.lm_head.weight, before)
        return
    torch.testing.assert_close(draft.lm_head(x), (x @ head.T)[:, [1, 2, 3, 5]], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="head_from_target"):  # a target head of another width
        method.init_from_target(draft, spec, torch.randn(10, 7))
