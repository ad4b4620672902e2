"""A model folder whose tokenizer loads like Kimi-K2.5's: through transformers' remote code.

Kimi-K2.5 ships `tiktoken.model` + `tokenization_kimi.py` + `tokenizer_config.json` (`auto_map` ->
the remote-code class `TikTokenTokenizer`; no `tokenizer.json`, no fast tokenizer) and is loaded
with `AutoTokenizer.from_pretrained(path, trust_remote_code=True)`. Those files are not available
offline, so `write_remote_tokenizer` lays out the same three files around the local stand-in BPE
of `specforge_k25/data/kimi_tokenizer.py`:

* `tiktoken.model`: its mergeable ranks in tiktoken's text format (`base64(token bytes) rank`);
* `tokenization_kimi.py`: `TOKENIZATION_KIMI_PY` below, written for these tests (a transformers
  `PreTrainedTokenizer` over `tiktoken.Encoding`; not Moonshot's file);
* `tokenizer_config.json`: `auto_map` {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
  null]}, `tokenizer_class`, [BOS]/[EOS]/[PAD] and every special token (Kimi's documented ones at
  their real ids, reserved fillers up to 163839) under `added_tokens_decoder`, the table
  transformers hands to the class as `added_tokens_decoder`.

Ordinary-text ids equal the local tokenizer's `encode_ordinary`; they are not Kimi's vocabulary.
`write_tiny_kimi_model` adds a tiny Kimi-K2.5 checkpoint (the cached `tiny_kimi_k25_path` one,
its vocab widened to Kimi's 163840) so the folder is a whole `target.path`.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

TOKENIZER_FILES = ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json")
AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}

# The remote-code module. `{pat_str}` is filled with the local BPE's pre-tokenization pattern.
TOKENIZATION_KIMI_PY = '''\
"""TikTokenTokenizer: a transformers slow tokenizer over a tiktoken BPE read from `tiktoken.model`.

Test stand-in for the remote-code tokenizer of Kimi-K2.5 (same file names, class name and
auto_map), written for specforge_k25's tests. Special tokens come from `tokenizer_config.json`'s
`added_tokens_decoder` (token string at its id); ordinary tokens are the ranks of `tiktoken.model`.
Token strings of ordinary tokens are their bytes in the reversible byte-to-printable-character
mapping of byte-level BPEs, so `tokenize` / `convert_tokens_to_ids` round-trip.
"""
import base64
import os
import shutil

import tiktoken
from transformers import PreTrainedTokenizer

PAT_STR = {pat_str!r}
VOCAB_FILES_NAMES = {{"vocab_file": "tiktoken.model"}}


def load_ranks(path):
    """`base64(token bytes) rank` per line -> {{bytes: rank}}."""
    ranks = {{}}
    with open(path, "rb") as fh:
        for line in fh.read().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_chars():
    """byte -> printable character: printable Latin-1 bytes are themselves, the others (controls,
    space, DEL, NBSP, soft hyphen) take code points 256, 257, ... in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, spare = {{}}, 256
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(spare)
            spare += 1
    return table


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token=None,
                 added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_ranks(vocab_file)
        special = {{str(token): int(idx) for idx, token in (added_tokens_decoder or {{}}).items()}}
        clash = sorted(i for i in special.values() if i < len(ranks))
        if clash:
            raise ValueError(f"special token ids {{clash[:5]}} overlap the {{len(ranks)}} ordinary ranks")
        self.model = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))) or "kimi",
            pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special,
        )
        to_char = byte_chars()
        self._byte_of = {{c: b for b, c in to_char.items()}}
        self._rank_of = {{"".join(to_char[b] for b in raw): rank for raw, rank in ranks.items()}}
        self._token_of = {{rank: token for token, rank in self._rank_of.items()}}
        kwargs.setdefault("special_tokens_pattern", "none")  # encode() adds no [BOS]/[EOS]
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return len(self._rank_of)

    def get_vocab(self):
        vocab = dict(self._rank_of)
        vocab.update(self._added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        # special-token strings were split off by `tokenize`; the rest is ordinary text
        return [self._token_of[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        rank = self._rank_of.get(token)
        return rank if rank is not None else self.unk_token_id

    def _convert_id_to_token(self, index):
        return self._token_of.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens):
        raw = bytes(self._byte_of[c] for token in tokens for c in token)
        return raw.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
'''


def write_remote_tokenizer(folder: str | Path, encoding=None) -> Path:
    """Write the three tokenizer files into `folder` (created if missing). `encoding`: a tiktoken
    `Encoding` (default: `build_kimi_local_tokenizer()`, cached)."""
    from specforge_k25.data.kimi_tokenizer import PAT_STR, build_kimi_local_tokenizer

    enc = encoding if encoding is not None else build_kimi_local_tokenizer()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1])
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks))
    (folder / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI_PY.format(pat_str=enc._pat_str or PAT_STR))
    special = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": AUTO_MAP,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": None,
        "model_max_length": 262144,
        "added_tokens_decoder": {
            str(idx): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True}
            for tok, idx in special
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_tiny_kimi_model(folder: str | Path, tiny_kimi_path: str | Path, vocab_size: int = 163840) -> Path:
    """Copy the tiny Kimi-K2.5 checkpoint into `folder` with its vocab widened to `vocab_size`
    (Kimi's; the cached checkpoint has SmolLM2's 49152): embedding and lm_head get extra seeded
    random rows, config.json the new vocab and Kimi's [BOS]/[EOS]/[PAD]/media ids. No tokenizer
    files are copied (the SmolLM2 ones would shadow the remote-code tokenizer)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, folder = Path(tiny_kimi_path), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
        w = weights[name]
        if w.shape[0] < vocab_size:
            extra = torch.randn(vocab_size - w.shape[0], w.shape[1], generator=g, dtype=torch.float32) * 0.02
            weights[name] = torch.cat([w, extra.to(w.dtype)])
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    ids = {"bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839}
    config["text_config"].update(vocab_size=vocab_size, **ids)
    config.update(media_placeholder_token_id=163605, **ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
