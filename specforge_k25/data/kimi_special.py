"""Kimi-K2.5's special tokens, read from a tokenizer's own table, and its ordinary-text encoder.

Used by the chat renderer (kimi_format.py, which re-exports every name here) and the local
tiktoken stand-in (kimi_tokenizer.py). The ids are docs/KIMI_K25.md §4's.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class KimiSpecialTokens:
    """Ids of Kimi-K2.5's special tokens (defaults: docs/KIMI_K25.md §4)."""

    bos: int = 163584
    eos: int = 163585
    im_end: int = 163586
    im_user: int = 163587
    im_assistant: int = 163588
    im_system: int = 163594
    tool_calls_section_begin: int = 163595
    tool_calls_section_end: int = 163596
    tool_call_begin: int = 163597
    tool_call_argument_begin: int = 163598
    tool_call_end: int = 163599
    im_middle: int = 163601
    media_begin: int = 163602
    media_content: int = 163603
    media_end: int = 163604
    media_pad: int = 163605
    think: int = 163606
    think_end: int = 163607
    pad: int = 163839

    # token string of every field
    NAMES = {
        "bos": "[BOS]", "eos": "[EOS]", "im_end": "<|im_end|>", "im_user": "<|im_user|>",
        "im_assistant": "<|im_assistant|>", "im_system": "<|im_system|>",
        "tool_calls_section_begin": "<|tool_calls_section_begin|>",
        "tool_calls_section_end": "<|tool_calls_section_end|>",
        "tool_call_begin": "<|tool_call_begin|>",
        "tool_call_argument_begin": "<|tool_call_argument_begin|>",
        "tool_call_end": "<|tool_call_end|>", "im_middle": "<|im_middle|>",
        "media_begin": "<|media_begin|>", "media_content": "<|media_content|>",
        "media_end": "<|media_end|>", "media_pad": "<|media_pad|>",
        "think": "<think>", "think_end": "</think>", "pad": "[PAD]",
    }

    def by_name(self) -> dict[str, int]:
        """token string -> id, e.g. {"<|im_end|>": 163586, ...}."""
        return {self.NAMES[f.name]: getattr(self, f.name) for f in fields(self)}

    def id_of(self, token: str) -> int:
        try:
            return self.by_name()[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a Kimi special token") from None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, int]) -> KimiSpecialTokens:
        """From a tokenizer's special-token table (token string -> id). The tokens the chat
        format uses must all be present; the others (media, [PAD], ...) fall back to defaults."""
        needed = {"bos", "eos", "media_begin", "media_content", "media_end", "media_pad", "pad"}
        kwargs, missing = {}, []
        for f in fields(cls):
            name = cls.NAMES[f.name]
            if name in mapping and mapping[name] is not None:
                kwargs[f.name] = int(mapping[name])
            elif f.name not in needed:
                missing.append(name)
        if missing:
            raise KeyError(f"tokenizer lacks Kimi special tokens {missing}")
        return cls(**kwargs)


def special_tokens_of(tokenizer) -> KimiSpecialTokens:
    """The special-token ids of `tokenizer`, read from its own table (never assumed):
    an `kimi_special` attribute, a tiktoken `Encoding`'s special tokens, or an HF tokenizer's
    added vocabulary."""
    own = getattr(tokenizer, "kimi_special", None)
    if isinstance(own, KimiSpecialTokens):
        return own
    table = getattr(tokenizer, "_special_tokens", None)  # tiktoken.Encoding
    if not isinstance(table, Mapping) and hasattr(tokenizer, "get_added_vocab"):
        table = tokenizer.get_added_vocab()  # transformers tokenizer
    if not isinstance(table, Mapping):
        table = getattr(tokenizer, "special_tokens", None)
    if not isinstance(table, Mapping):
        raise TypeError(
            f"{type(tokenizer).__name__} has no special-token table; pass special=KimiSpecialTokens(...)"
        )
    return KimiSpecialTokens.from_mapping(table)


def check_remote_code_tokenizer(tokenizer) -> None:
    """Refuse a transformers tokenizer loaded past its folder's remote code.

    Kimi-K2.5's folder maps AutoTokenizer to remote code (`tokenizer_config.json` `auto_map` ->
    `tokenization_kimi.TikTokenTokenizer`). Without trust_remote_code, transformers >= 5.13
    does not refuse such a folder when config.json says `model_type: kimi_k25`: it builds its own
    fast tokenizer from `tiktoken.model` with a generic pre-tokenization regex, so the special
    ids are right but ordinary text can split differently from the served tokenizer (seen on
    digit runs with tests/kimi_remote_tokenizer.py). Training on those ids would be silently off.
    """
    path = getattr(tokenizer, "name_or_path", None)
    if not path or not hasattr(tokenizer, "get_added_vocab"):
        return
    config = Path(str(path)) / "tokenizer_config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") if config.is_file() else None
    except (OSError, ValueError):
        return
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = [n for n in (entry if isinstance(entry, list) else [entry]) if isinstance(n, str) and n]
    cls = type(tokenizer)
    if names and cls.__name__ not in {n.rsplit(".", 1)[-1] for n in names}:
        raise ValueError(
            f"{path}: tokenizer_config.json maps AutoTokenizer to remote code {names}, but the tokenizer "
            f"was loaded as {cls.__module__}.{cls.__name__} (transformers' own substitute, whose ordinary-text "
            "ids may differ from the served tokenizer's); load it with trust_remote_code=True "
            "(target.trust_remote_code=true)"
        )


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """`str -> ids` for ordinary text: no BOS/EOS added, special-token strings not parsed."""
    if hasattr(tokenizer, "encode_ordinary"):  # tiktoken
        return lambda text: list(tokenizer.encode_ordinary(text))
    if hasattr(tokenizer, "get_added_vocab"):  # transformers
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    return lambda text: list(tokenizer.encode(text))
