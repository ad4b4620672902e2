"""Render conversations with the target's chat template into `input_ids` + `loss_mask`.

The mask covers exactly what the assistant generates when served: the tokens of each
assistant turn and its end-of-turn token. Template text around it (role headers, the
newline after the end-of-turn token, system/user turns) is 0.

Method: for assistant turn i, render messages[:i] with the generation prompt and
messages[:i+1]; the tokens the second adds are the turn, cut after the first end-of-turn
token. This needs a prefix-stable template (rendering a longer conversation only appends),
which is checked for every row: a template that is not prefix-stable gives `BadRow`,
never a wrong mask.

Tool use: an assistant turn's tool calls are part of what it generates, so they are inside
its rendered turn and masked with it; tool results are rendered as the template writes them,
never masked. A row with tool calls or tool results is only rendered by a template that writes
both into the text (probed once per tokenizer, `template_renders_tools`); SmolLM2's, like many
small-model templates, prints only `content` and would silently drop the calls, giving a
conversation the served model never sees, so such rows are skipped as
`tools_unsupported_by_template`. As SGLang does before rendering, a call's JSON-string
`arguments` are handed to the template parsed (a dict).

Content given as OpenAI text parts reaches the template as SGLang 0.5.23 hands it over: as the
parts, to a template that reads them itself (its "openai" content format), otherwise joined
with a space (its "string" format, e.g. SmolLM2's, Llama 3's, DeepSeek-V3's templates; and a
tool result's parts always). Which one a template is, is probed the same way (`template_reads_parts`).
"""
from __future__ import annotations

import json
import weakref
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


_TOOL_PROBE = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
        "name": "probe_tool_name", "arguments": {"probe_argument": "probe_value"}}}]},
    {"role": "tool", "tool_call_id": "call_probe", "name": "probe_tool_name", "content": "probe tool result"},
    {"role": "assistant", "content": "probe answer"},
]
_PARTS_PROBE = [
    {"role": "user", "content": [{"type": "text", "text": "probe_part_a"}, {"type": "text", "text": "probe_part_b"}]},
    {"role": "assistant", "content": "probe answer"},
]
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(probe, template): bool}


def _probe(tokenizer, name: str, messages: list[dict], check) -> bool:
    """`check(rendered text)` for a probe conversation, cached per tokenizer and template."""
    key = (name, getattr(tokenizer, "chat_template", None))
    try:
        cache = _probed.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: probe every time
        cache = {}
    if key not in cache:
        try:
            text = str(tokenizer.apply_chat_template(messages, tokenize=False))
        except Exception:  # a template may raise on roles, fields or content it does not know
            text = ""
        cache[key] = bool(check(text))
    return cache[key]


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template writes an assistant tool call (name and arguments) and a tool
    result into the rendered text."""
    return _probe(tokenizer, "tools", _TOOL_PROBE, lambda text: all(
        s in text for s in ("probe_tool_name", "probe_value", "probe tool result")))


def template_reads_parts(tokenizer) -> bool:
    """Whether the template renders OpenAI text parts itself (not as a printed list, not failing)."""
    return _probe(tokenizer, "parts", _PARTS_PROBE, lambda text: "probe_part_a" in text and
                  "probe_part_b" in text and "'type'" not in text and '"type"' not in text)


def _texts(message: dict) -> list[str]:
    """Every text of a message that reaches the template."""
    out = [message["content"]]
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        out += [call["function"]["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)]
    return out


def _for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """Copies as SGLang hands them to templates: text parts as parts or joined with a space,
    JSON-string tool-call arguments parsed."""
    out = []
    for m in messages:
        if "content_parts" in m:
            parts = m["content_parts"]
            m = {k: v for k, v in m.items() if k != "content_parts"}
            # SGLang flattens a tool result's text parts for every template
            m["content"] = ([{"type": "text", "text": t} for t in parts]
                            if m["role"] != "tool" and template_reads_parts(tokenizer) else " ".join(parts))
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])
                                   if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]}}
                for c in m["tool_calls"]]}
        out.append(m)
    return out


def template_prompt_ids(tokenizer, messages) -> list[int]:
    """The generation prompt after `messages`, exactly as `tokenize_conversation` renders the
    prompt of each assistant turn (and as SGLang renders a request)."""
    return _render(tokenizer, _for_template(tokenizer, list(messages)), add_generation_prompt=True)


def tokenize_conversation(tokenizer, messages, max_length: int, end_of_turn_id: int) -> Sample:
    """messages -> Sample, truncated to `max_length` tokens. Raises `BadRow`."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    if any(tok in text for m in messages for text in _texts(m) for tok in specials):
        # e.g. "<|im_start|>user" inside a reply would forge a header inside the loss mask
        raise BadRow("special_token_in_text")
    if any(m["role"] == "tool" or m.get("tool_calls") for m in messages) and not template_renders_tools(tokenizer):
        raise BadRow("tools_unsupported_by_template")
    messages = _for_template(tokenizer, messages)
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
