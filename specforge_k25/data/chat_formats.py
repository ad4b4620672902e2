"""The chat formats a run renders its conversations in, by name (`target.chat_format`): each gives
the training renderer (`(messages, max_length) -> Sample`, or None for the tokenizer's own chat
template, `build_dataset`'s default path) and the generation-prompt renderer (`messages -> ids`,
what regeneration and the eval send the target), from the tokenizer and the target's config
(duck-typed: `chat_mode` and, for Kimi, its `kimi` options)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ChatFormat:
    name: str
    summary: str
    renderer: Callable  # (tokenizer, target) -> render for build_dataset, None: the chat template
    prompt_renderer: Callable  # (tokenizer, target) -> messages -> generation prompt ids


def _template_prompt(tokenizer, target):
    from .tokenize import template_prompt_ids

    return lambda messages: template_prompt_ids(tokenizer, messages)


def _kimi(tokenizer, target):
    from .kimi_format import kimi_format_of, kimi_renderer

    return kimi_renderer(tokenizer, mode=target.chat_mode, fmt=kimi_format_of(target))


def _kimi_prompt(tokenizer, target):
    from .kimi_format import kimi_format_of, kimi_prompt_renderer

    return kimi_prompt_renderer(tokenizer, mode=target.chat_mode, fmt=kimi_format_of(target))


CHAT_FORMATS = {f.name: f for f in (
    ChatFormat("template", "the tokenizer's own chat template", lambda tokenizer, target: None, _template_prompt),
    ChatFormat("kimi", "Kimi-K2.5's format as SGLang serves it (thinking / instant, tools; target.kimi.*, "
                       "docs/KIMI_K25.md §5)", _kimi, _kimi_prompt),
)}


def chat_format(name: str) -> ChatFormat:
    if name not in CHAT_FORMATS:
        raise ValueError(f"target.chat_format={name!r}: expected one of {' | '.join(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]
