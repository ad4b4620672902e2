"""A local stand-in for Kimi's tiktoken tokenizer: same special tokens at the real ids.

Kimi's `tiktoken.model` is not available offline. This builds a small byte-level BPE
(`tokenizers` trainer, a few MB of the packaged ShareGPT text), exports it as tiktoken
mergeable ranks and wraps it in `tiktoken.Encoding` with Kimi's special tokens at their real
ids (docs/KIMI_K25.md §4). Ordinary ids are < `vocab_size`; special tokens sit at 163584..163839 (the
ids without a documented name are filled with `<|reserved_token_{id}|>`), so `n_vocab` is the
target's 163840. The merges are cached under `cache_root()/kimi_local_tokenizer/`.

Use it to exercise the tiktoken / Kimi code path (chat format, vocab mapping); it is not
Kimi's vocabulary, so ordinary-text ids mean nothing to a real Kimi model.
"""
from __future__ import annotations

import base64
from pathlib import Path

from ..paths import write_text_atomic
from .kimi_special import KimiSpecialTokens

FIRST_SPECIAL_ID = 163584
VOCAB_END = 163840  # Kimi-K2.5 vocab size
FORMAT_VERSION = 1

# Pre-tokenization: the GPT-2 style split that `tokenizers`' ByteLevel pre-tokenizer applies
# during training (contractions, optional space + letters / digits / other symbols, whitespace),
# so that training and tiktoken encoding see the same chunks.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def kimi_special_token_table(special: KimiSpecialTokens | None = None, fill_reserved: bool = True) -> dict[str, int]:
    """Special-token string -> id, documented names plus reserved fillers up to the vocab end."""
    table = (special or KimiSpecialTokens()).by_name()
    if fill_reserved:
        used = set(table.values())
        for i in range(FIRST_SPECIAL_ID, VOCAB_END):
            if i not in used:
                table[f"<|reserved_token_{i}|>"] = i
    return table


def _byte_to_char() -> dict[int, str]:
    """The reversible byte -> printable character table byte-level BPE vocabularies use:
    printable Latin-1 bytes map to themselves, the rest to code points from 256 upward."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _corpus(max_chars: int):
    from .sources import iter_source

    total = 0
    for row in iter_source("sharegpt", None):
        turns = row.get("conversations") if isinstance(row, dict) else None
        for turn in turns or []:
            text = turn.get("value") if isinstance(turn, dict) else None
            if isinstance(text, str) and text:
                text = text[: max_chars - total]
                total += len(text)
                yield text
                if total >= max_chars:
                    return


def train_ranks(vocab_size: int = 8192, corpus_chars: int = 4_000_000) -> dict[bytes, int]:
    """Train a byte-level BPE and return tiktoken mergeable ranks (bytes -> rank).

    Single bytes get ranks 0..255 (byte value); merged tokens follow in the order the trainer
    created them, which is the merge priority tiktoken's BPE applies."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(corpus_chars), trainer)
    char_to_byte = {c: b for b, c in _byte_to_char().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        raw = bytes(char_to_byte[c] for c in token)
        if raw not in ranks:
            ranks[raw] = len(ranks)
    return ranks


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    write_text_atomic(path, "".join(lines))


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_kimi_local_tokenizer(vocab_size: int = 8192, corpus_chars: int = 4_000_000, *,
                               special: KimiSpecialTokens | None = None, cache: bool = True):
    """tiktoken `Encoding` with a locally trained BPE and Kimi's special tokens at real ids."""
    import tiktoken

    if not 256 < vocab_size <= FIRST_SPECIAL_ID:
        raise ValueError(f"vocab_size={vocab_size}: expected 257..{FIRST_SPECIAL_ID}")
    if cache:  # trained once however many processes ask (paths.build_once), then read by each
        from ..paths import build_once, cache_root

        path = cache_root() / "kimi_local_tokenizer" / f"v{FORMAT_VERSION}-bpe{vocab_size}-chars{corpus_chars}.tiktoken"
        ranks = _read_ranks(build_once(path, lambda out: _write_ranks(out, train_ranks(vocab_size, corpus_chars))))
    else:
        ranks = train_ranks(vocab_size, corpus_chars)
    return tiktoken.Encoding(
        f"kimi_k25_local_bpe{vocab_size}",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=kimi_special_token_table(special),
    )
