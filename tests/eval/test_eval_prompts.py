"""Eval prompts are rendered by the run's own renderer (`setup.run.prompt_renderer`): the Kimi
renderer for `target.chat_format=kimi`, the chat template otherwise."""
from __future__ import annotations

from specforge_k25.config import compose_job
from specforge_k25.data.kimi_format import kimi_prompt_renderer
from specforge_k25.data.kimi_tokenizer import build_kimi_local_tokenizer
from specforge_k25.eval.prompts import load_prompt_set, mtbench_questions
from specforge_k25.setup.run import prompt_renderer

IM_USER, IM_ASSISTANT, IM_MIDDLE, THINK, THINK_END = 163587, 163588, 163601, 163606, 163607


def test_kimi_eval_prompts_follow_the_kimi_renderer_and_chat_mode():
    tok = build_kimi_local_tokenizer()
    for mode in ("thinking", "instant"):
        job = compose_job(["target=tiny_kimi", "target.chat_format=kimi", f"target.chat_mode={mode}"])
        prompts = load_prompt_set("mtbench", 3, prompt_renderer(job.target, tok))
        want = [kimi_prompt_renderer(tok, mode=mode)([{"role": "user", "content": q}]) for q in mtbench_questions()[:3]]
        assert prompts == want
        # the served generation prompt: the user turn, then the assistant header and <think> (+ </think>)
        end = [IM_ASSISTANT, *tok.encode_ordinary("assistant"), IM_MIDDLE, THINK] + ([THINK_END] if mode == "instant" else [])
        assert all(p[0] == IM_USER and p[-len(end):] == end for p in prompts)


def test_template_eval_prompts_are_the_chat_templates_generation_prompt():
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.models import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    job = compose_job([])
    prompts = load_prompt_set("humaneval", 2, prompt_renderer(job.target, tok))
    q = "Complete the following Python function.\n\n```python\n"
    for p in prompts:
        text = tok.decode(p)
        assert q in text and text.endswith("<|im_start|>assistant\n")
