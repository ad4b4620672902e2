"""The sampling rule and decode loop every engine shares (target_engine/sampling.py), and the HF
reference's generation against transformers' own greedy `generate`."""
from __future__ import annotations

import pytest

import torch

from specforge_k25.target_engine.sampling import (Regeneration, generate_with, generation_slots, kv_slots,
                                          request_generator, sample_next)


def test_greedy_is_argmax_and_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next(logits, 0.0, 1.0, []).tolist() == [1, 0]
    # probabilities of row 0 at T=1: [0.032, 0.644, 0.087, 0.237]: top_p 0.6 keeps token 1 alone
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    for _ in range(20):
        assert sample_next(logits, 1.0, 0.6, gens)[0] == 1
    # top_p 0.85 keeps {1, 3}: never 0 or 2, both kept tokens drawn
    seen = {int(sample_next(logits, 1.0, 0.85, gens)[0]) for _ in range(200)}
    assert seen == {1, 3}


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.3), (0.5, 0.999)])
def test_the_batched_device_rule_draws_what_the_row_loop_draws(temperature, top_p):
    """On a GPU `sample_next` sorts and cuts the whole batch where the logits are
    (`_nucleus_on_device`); run on the CPU it must draw the row loop's tokens from the same
    generators (and leave them in the same state), ties and a whole-vocabulary top_p included."""
    from specforge_k25.target_engine.sampling import _nucleus_on_device

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top: the lower id first
    logits[2] = 0.0  # a flat row: every token equally likely
    logits = logits.to(torch.bfloat16)  # as a GPU engine hands them
    loop_gens = [torch.Generator().manual_seed(10 + b) for b in range(6)]
    batch_gens = [torch.Generator().manual_seed(10 + b) for b in range(6)]
    for _ in range(10):
        want = sample_next(logits, temperature, top_p, loop_gens)
        assert torch.equal(_nucleus_on_device(logits, temperature, top_p, batch_gens), want)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(loop_gens, batch_gens))


def test_greedy_takes_the_argmax_of_the_logits_as_they_are():
    """temperature 0 no longer converts to float64 first: exact for bf16/fp32, so the same ids,
    the first of tied maxima included."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[0, 5] = logits[0, 8] = logits[0].max() + 1
    got = sample_next(logits, 0.0, 1.0, [])
    assert got.dtype == torch.int64 and torch.equal(got, logits.double().argmax(-1)) and got[0] == 5


def test_a_prompts_random_stream_is_reproducible_and_its_own():
    p, q = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])
    a = torch.rand(4, generator=request_generator(7, p))
    assert torch.equal(a, torch.rand(4, generator=request_generator(7, p)))
    assert not torch.equal(a, torch.rand(4, generator=request_generator(7, q)))
    assert not torch.equal(a, torch.rand(4, generator=request_generator(8, p)))


def test_decode_loop_stops_at_a_stop_id_or_the_budget():
    """A fake engine whose next token is (last fed token + 1) % 10: request 0 reaches the stop id
    9, request 1 runs out of budget, request 2 has none."""
    prompts = [torch.tensor([5]), torch.tensor([0]), torch.tensor([3])]
    fed = [[int(p[-1])] for p in prompts]

    def step(tokens, rows):
        if tokens is not None:
            for b, t in zip(rows, tokens.tolist()):
                fed[b].append(t)
        return torch.nn.functional.one_hot(torch.tensor([(fed[b][-1] + 1) % 10 for b in rows]), 10).float()

    out = generate_with(step, prompts, [8, 3, 0], Regeneration(stop_ids=(9,)))
    assert out == [[6, 7, 8, 9], [1, 2, 3], []]
    assert fed == [[5, 6, 7, 8], [0, 1, 2], [3]]  # a finished request is fed nothing more


class SlotCountingEngine:
    """A decode engine that allocates KV slots as SGLang's extend and decode do (a prompt's worth
    per request, then one slot per request in the batch per step) from a pool of `pool` slots;
    its next token is always 1."""

    def __init__(self, prompts, pool):
        self.lengths = [len(p) for p in prompts]
        self.pool, self.used = pool, 0

    def __call__(self, tokens, rows):
        if tokens is None:
            self.used += sum(self.lengths)
        else:
            self.used += len(rows)
            for b in rows:
                self.lengths[b] += 1
        if self.used > self.pool:
            raise MemoryError(f"decode out of memory: {self.used} > {self.pool} slots")
        return torch.nn.functional.one_hot(torch.ones(len(rows), dtype=torch.int64), 4).float()


def test_generation_fits_the_pool_its_admission_counts():
    """Issue 18 §3: seven 2,000-token prompts and one of 100, max_length 2048, 1,024 new tokens.
    Counted as prompt + budget they take 15,460 slots and pass a 16,384-slot pool; keeping the
    finished requests in the batch would allocate 14,100 + 8 x 1,023 = 22,284 (SGLang's decode OOM)."""
    regen = Regeneration(max_new_tokens=1024, max_length=2048)
    prompts = [torch.zeros(2000, dtype=torch.int64)] * 7 + [torch.zeros(100, dtype=torch.int64)]
    budgets = [regen.budget(len(p)) for p in prompts]
    assert budgets == [48] * 7 + [1024] and sum(len(p) + b for p, b in zip(prompts, budgets)) == 15460
    assert kv_slots(2000, 48) == 2047 and kv_slots(100, 1024) == 1123 and kv_slots(5, 0) == 5
    assert generation_slots([len(p) for p in prompts], budgets) == 7 * 2047 + 1123 == 15452
    assert kv_slots(2000, 48, page_size=64) == 2048 and kv_slots(100, 1024, page_size=64) == 1152

    engine = SlotCountingEngine(prompts, pool=16384)
    answers = generate_with(engine, prompts, budgets, regen)
    assert [len(a) for a in answers] == budgets
    assert engine.used == generation_slots([len(p) for p in prompts], budgets)  # the count is the real peak
    assert max(engine.lengths) < regen.max_length  # no sequence outgrows prompt + budget


@pytest.mark.slow
def test_hf_reference_generates_what_transformers_generates(smollm2_path):
    """Greedy answers of our decode loop on HF's model == transformers' own greedy generate."""
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.hf_reference import HFTarget

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    target = HFTarget(smollm2_path, [2, 15, 27])
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ("The capital of France is", "def add(a, b):")]
    ours = target.generate(prompts, [12, 12], Regeneration(stop_ids=(tok.eos_token_id,)))
    for prompt, answer in zip(prompts, ours):
        ref = target.model.generate(prompt[None], max_new_tokens=12, do_sample=False,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(prompt):]
        assert answer == ref.tolist()[:len(answer)] and len(answer) == len(ref)
