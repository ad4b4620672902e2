"""Regeneration in the real SGLang engine (data.regenerate): the target answers each prompt with
SGLang's own extend/decode steps, then the conversation is prefilled; the stream carries its ids.
Checked against the HF reference: the answers are HF's greedy answers (TP 1: token for token;
TP 2: every chosen token is HF's argmax up to fp32 ties) and the captured states are HF's plain
prefill of the same ids."""
from __future__ import annotations

import pytest
import torch

from specforge_k25.stream.target_stream import TargetStream
from specforge_k25.target_engine.factory import TargetSpec
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import default_capture_points
from specforge_k25.target_engine.sampling import Regeneration


def _rel(a, b) -> float:
    """max |a - b| / (1e-4 * max(1, |b|)): <= 1 is fp32 agreement."""
    return float(((a - b).abs() / (1e-4 * b.abs().clamp(min=1))).max())


def _regenerate_through_the_stream(path, prompts, regen, batches=([0, 1], [2]), **spec_fields):
    info = read_target_info(path)
    points = default_capture_points(info.num_layers)
    spec = TargetSpec(engine="sglang", model_path=path, architecture=info.architecture, capture_points=points,
                      regeneration=regen, **{"num_threads": 2, **spec_fields})
    got = []
    with TargetStream(spec, prompts, list(batches), hidden_size=info.hidden_size, slots=2, timeout_s=600) as stream:
        for msg, aux, final in stream:
            ids = torch.split(stream.ids(msg).clone(), msg.lengths)
            got += list(zip(msg.prompt_lengths, ids, torch.split(aux.clone(), msg.lengths),
                            torch.split(final.clone(), msg.lengths)))
            stream.release(msg)
    return got, HFTarget(path, points)


def _check_states(got, ref_aux, ref_final):
    for (_, _, aux, final), r_aux, r_final in zip(got, ref_aux, ref_final):
        assert _rel(aux, r_aux) <= 1.0 and _rel(final, r_final) <= 1.0


@pytest.mark.engine
def test_sglang_answers_as_hf_and_captures_a_plain_prefill(smollm2_path, sglang_capture):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    questions = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
                 "Answer in one word, without explaining: " * 6 + "is rain wet?"]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(torch.tensor(ids["input_ids"] if hasattr(ids, "keys") else ids))
    # the long last prompt leaves room for 2 new tokens only; the others get all 16
    regen = Regeneration(max_new_tokens=16, max_length=len(prompts[-1]) + 2, stop_ids=(end, tok.eos_token_id))
    budgets = [regen.budget(len(p)) for p in prompts]
    assert budgets == [16, 16, 16, 2]
    answers = HFTarget(smollm2_path, default_capture_points(30)).generate(prompts, budgets, regen)
    # A KV pool of exactly prompt + budget per request, as the admission check counts: keeping the
    # finished requests in the decode batch (issue 18 §3) would allocate one slot each per step.
    pool = sum(len(p) + b for p, b in zip(prompts, budgets))
    assert sum(len(p) for p in prompts) + len(prompts) * (max(len(a) for a in answers) - 1) > pool
    got, _ = _regenerate_through_the_stream(smollm2_path, prompts, regen, batches=([0, 1], [2, 3]),
                                            max_total_tokens=pool)
    for prompt, answer, (prompt_len, ids, _, _) in zip(prompts, answers, got):
        assert prompt_len == len(prompt) and ids[:prompt_len].tolist() == prompt.tolist()
        assert ids[prompt_len:].tolist() == answer, tok.decode(ids[prompt_len:])
    # the states of the regenerated conversations == the same engine's plain prefill of those ids
    plain = sglang_capture(smollm2_path, default_capture_points(30), [ids for _, ids, _, _ in got])
    _check_states(got, [a for lengths, aux, _ in plain for a in torch.split(aux, lengths)],
                  [f for lengths, _, final in plain for f in torch.split(final, lengths)])


@pytest.mark.engine
def test_tp2_ranks_decode_in_step(tiny_deepseek_path):
    """TP 2: both ranks run SGLang's decode steps on rank 0's prompts and draw the same tokens;
    each chosen token is the HF reference's argmax (or within fp32 noise of it)."""
    info = read_target_info(tiny_deepseek_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (9, 14, 6)]
    regen = Regeneration(max_new_tokens=6, max_length=64, stop_ids=(0,))
    got, hf = _regenerate_through_the_stream(tiny_deepseek_path, prompts, regen, tp_size=2, num_threads=1)
    for prompt_len, ids, _, _ in got:
        assert prompt_len < len(ids) <= prompt_len + 6
        logits = hf.model(ids[None]).logits[0, prompt_len - 1:-1]  # the logits each answer token was drawn from
        chosen = logits.gather(-1, ids[prompt_len:, None])[:, 0]
        assert (logits.max(-1).values - chosen <= 1e-4 * logits.abs().max()).all()
    refs = [hf.forward([ids]) for _, ids, _, _ in got]
    _check_states(got, [r.aux_hidden for r in refs], [r.final_hidden for r in refs])
