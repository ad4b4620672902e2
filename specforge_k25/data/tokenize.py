"""Render conversations with the target's chat template into `input_ids` + `loss_mask`.

The mask covers exactly what the assistant generates when served: the tokens of each
assistant turn and its end-of-turn token. Template text around it (role headers, the
newline after the end-of-turn token, system/user turns) is 0.

Method: for assistant turn i, render messages[:i] with the generation prompt and
messages[:i+1]; the tokens the second adds are the turn, cut after the first end-of-turn
token. This needs a prefix-stable template (rendering a longer conversation only appends),
which is checked for every row: a template that is not prefix-stable gives `BadRow`,
never a wrong mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sources import BadRow


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    truncated: bool = False  # cut to max_length


def make_sample(ids: list[int], mask: list[bool], max_length: int) -> Sample:
    """Truncate to `max_length`; a row left with no trainable loss token raises `BadRow`."""
    truncated = len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    # A position t is only trainable with t >= 2 (the draft predicts x[t+k+2]).
    if not any(mask[2:]):
        raise BadRow("no_loss_tokens_after_truncation")
    return Sample(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool), truncated)


def _render(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def tokenize_conversation(tokenizer, messages, max_length: int, end_of_turn_id: int) -> Sample:
    """messages -> Sample, truncated to `max_length` tokens. Raises `BadRow`."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    if any(tok in m["content"] for m in messages for tok in specials):
        # e.g. "<|im_start|>user" inside a reply would forge a header inside the loss mask
        raise BadRow("special_token_in_text")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    mask = [False] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            raise BadRow("template_not_prefix_stable")
        turn = upto[len(prompt):]
        if end_of_turn_id not in turn:
            raise BadRow("no_end_of_turn_token")
        n = turn.index(end_of_turn_id) + 1
        if n <= 1:
            raise BadRow("empty_turn")
        for t in range(len(prompt), len(prompt) + n):
            mask[t] = True
    return make_sample(full, mask, max_length)
