"""Acceptance-length replay (specforge_k25/eval/acceptance.py) on hand-made cases with known
answers, and its alignment with the training metric (ttt_loss's acc_k counts)."""
from __future__ import annotations

import math

import pytest
import torch

from specforge_k25.draft.eagle3_mla.model import Eagle3MLADraft, MLADraftConfig
from specforge_k25.draft.objective import Teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps, target_to_draft
from specforge_k25.draft.eagle3.replay import chain_proposals as draft_predictions
from specforge_k25.eval.acceptance import (
    draft_proposer,
    prompt_lookup_proposer,
    replay,
    step_counts,
    tau_sim,
)


def test_replay_known_answers():
    prompt = [5, 6, 7]
    completion = list(range(100, 110))  # n = 10: one token from the prefill, 9 left to verify
    seq = prompt + completion
    never = replay(seq, len(prompt), lambda root: [-1, -1, -1])
    assert never == (10, 9)  # every verify step yields only the bonus token
    perfect = replay(seq, len(prompt), lambda root: seq[root + 1: root + 4])
    assert perfect == (10, math.ceil(9 / 4))  # 3 drafts + bonus per step: 4, 4, 1
    # right first draft only: 2 tokens per step -> 9 tokens in 5 steps
    assert replay(seq, len(prompt), lambda root: seq[root + 1: root + 2] + [-1]) == (10, 5)
    assert replay(prompt, len(prompt), lambda root: []) == (0, 0)


def test_prompt_lookup_proposer():
    seq = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    propose = prompt_lookup_proposer(seq, num_tokens=3, ngram_max=3, ngram_min=1)
    assert propose(8) == [4, 9, 9]  # trigram 1 2 3 seen at the start, followed by 4 9 9
    assert propose(5) == [9]  # unigram 9 seen at index 4; only what is already committed follows it
    assert propose(3) == []  # 1 2 3 4: no earlier occurrence of any suffix
    # replayed: a completion that repeats its prompt is drafted perfectly after the first token
    prompt = [7, 8, 9, 10, 11, 12, 13]
    seq = prompt + [7, 8, 9, 10, 11, 12, 13]
    n, steps = replay(seq, len(prompt), prompt_lookup_proposer(seq, 3))
    assert (n, steps) == (7, 2)  # 6 tokens left after the prefill's: two steps of 3 drafts + bonus


def test_draft_proposer_indexing():
    """Row k, column t of the predictions is the proposal for x[t+k+2] when x[t+1] is the root."""
    seq = list(range(50, 62))
    prompt_len, steps = 4, 3
    perfect = torch.tensor([[seq[t + k + 2] if t + k + 2 < len(seq) else -1 for t in range(len(seq))]
                            for k in range(steps)])
    n = len(seq) - prompt_len
    assert replay(seq, prompt_len, draft_proposer(perfect)) == (n, math.ceil((n - 1) / (steps + 1)))
    # break the second draft of the first verify step (root = prompt_len, column root-1)
    broken = perfect.clone()
    broken[1, prompt_len - 1] = -1
    # step 1 accepts 1 draft + bonus (2 tokens), then 4 per step: 7 left -> 2 more steps
    assert replay(seq, prompt_len, draft_proposer(broken)) == (n, 3)


def _tiny_draft(seed=0, mla=False):
    """A float64 head of either draft method (eagle3: Llama attention, eagle3_mla: MLA), 3 aux states."""
    torch.manual_seed(seed)
    if mla:
        cfg = MLADraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, q_lora_rank=12,
                             kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, vocab_size=12,
                             draft_vocab_size=8, target_hidden_size=16)
        draft = Eagle3MLADraft(cfg).double()
    else:
        cfg = DraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=12, draft_vocab_size=8, target_hidden_size=16)
        draft = Eagle3Draft(cfg).double()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.5 * torch.randn_like(p))
    d2t, t2d = build_vocab_maps(torch.arange(12, 0, -1), 8)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


@pytest.mark.parametrize("mla", [False, True], ids=["eagle3", "eagle3_mla"])
def test_step_counts_equal_the_training_metric(mla):
    """On a greedy output (the target's argmax IS the next token), acc_k counted by the eval
    equals ttt_loss's `correct` / `scored` with the completion as loss mask, for a head of
    either method (the replay keeps each step's cache as training does: K/V or MLA's latent)."""
    draft = _tiny_draft(mla=mla)
    T, prompt_len, K = 14, 5, 4
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 12, (T,), generator=g)
    aux = torch.randn(T, 48, generator=g, dtype=torch.float64)
    # make the output partly predictable: each token after the prompt is the draft's own step-0 proposal
    for t in range(prompt_len, T):
        seq[t] = draft_predictions(draft, aux, seq, 1)[0, t - 2] if t >= 2 else seq[t]
    predictions = draft_predictions(draft, aux, seq, K)
    correct, scored = step_counts(predictions, seq.tolist(), prompt_len)

    next_token = torch.cat([seq[1:], seq[:1]])  # teacher argmax at t = x[t+1]
    teacher = Teacher(torch.zeros(1, T, 8, dtype=torch.float64), torch.zeros(1, T, dtype=torch.float64),
                      target_to_draft(draft.d2t, 12)[next_token][None])
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, prompt_len + 1:] = True
    res = ttt_loss(draft, aux[None], seq[None], loss_mask, torch.tensor([T]), teacher, ttt_length=K)
    assert correct == res.correct.tolist() and scored == res.scored.tolist()
    assert correct[0] > 0  # the case is not trivially all-miss
    assert abs(tau_sim(correct, scored) - (1 + sum(math.prod(c / s for c, s in zip(correct[:k + 1], scored[:k + 1]))
                                                   for k in range(K)))) < 1e-12


def test_servings_of_each_method_and_aux_columns():
    """Each method reads eval.chains into its servings: a chain drafter at each chain, DFlash at a
    block of each distinct num_draft_tokens; a head's capture points are picked out of the run's aux
    in the head's order, or refused when not captured."""
    from specforge_k25.draft.registry import METHODS
    from specforge_k25.eval.run import aux_columns

    chains = [[3, 1, 4], [7, 1, 8], [5, 1, 8]]
    for name in ("eagle3", "eagle3_mla"):
        servings = METHODS[name].servings(chains)
        assert [(s.label, s.depth, s.draft_tokens) for s in servings] == [("3/1/4", 3, 4), ("7/1/8", 7, 8), ("5/1/8", 5, 8)]
        assert servings[0].sglang_args == {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                           "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
        assert servings[1].vllm_speculative_config == {"method": "eagle3", "num_speculative_tokens": 7}
    blocks = METHODS["dflash"].servings(chains)
    assert [(s.label, s.depth, s.draft_tokens) for s in blocks] == [("block 4", 3, 4), ("block 8", 7, 8)]
    assert blocks[1].sglang_args["speculative_num_steps"] == 1 and blocks[1].vllm_speculative_config["num_speculative_tokens"] == 7
    aux = torch.arange(3)[None].repeat_interleave(2, 1)  # [1, 6]: point index of each column (H = 2)
    assert torch.equal(aux[:, aux_columns([2, 15, 27], [2, 15, 27], 2)], aux)
    assert torch.equal(aux[:, aux_columns(None, [2, 15, 27], 2)], aux)
    assert aux[:, aux_columns([27, 2], [2, 15, 27], 2)].tolist() == [[2, 2, 0, 0]]
    assert aux_columns([3, 15], [2, 15, 27], 2) is None
    with pytest.raises(ValueError, match="block size 1"):
        METHODS["dflash"].servings([[1, 1, 1]])
