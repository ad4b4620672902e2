"""Load a target's tokenizer, with a stand-in for Kimi's remote-code tokenizer when that code fails.

Kimi-K2.5 ships its tokenizer as three files: `tiktoken.model` (the BPE ranks),
`tokenizer_config.json` (`auto_map` -> `tokenization_kimi.TikTokenTokenizer`, the special tokens
under `added_tokens_decoder`) and `tokenization_kimi.py` (the class, run as transformers remote code).
That code can fail on the transformers this project pins (SGLang 0.5.23 -> transformers 5.19): the
K2-family files as first published import `bytes_to_unicode` from
`transformers.models.gpt2.tokenization_gpt2`, which transformers 5 no longer defines there, so
`AutoTokenizer.from_pretrained(path, trust_remote_code=True)` raises ImportError (docs/KIMI_K25.md §4).

`load_tokenizer(path, trust_remote_code)` returns the folder's own class whenever it loads. When
the folder's remote code fails, it builds `TikTokenTokenizer` below from the same three files and
prints one line saying why. That class behaves as Moonshot's does on transformers 5: the same
ranks, the pre-tokenization pattern written in the folder's `tokenization_kimi.py` (read with `ast`,
never run), the special tokens at the ids Moonshot's class gives them (the 256 ids after the ordinary
ranks, named by `added_tokens_decoder`), and the same encode / decode paths.
tests/data/test_kimi_tokenizer_path.py compares the two id for id.
"""
from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedTokenizer

from .kimi_tokenizer import _byte_to_char, _read_ranks

VOCAB_FILE = "tiktoken.model"
# Moonshot's class adds these when tokenizer_config.json lists no additional_special_tokens; the
# names it lacks become added tokens past the vocabulary, so the stand-in must add the same ones.
DEFAULT_ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")
# Moonshot's class encodes text in pieces of at most this many characters (tiktoken can panic on
# longer input), and cuts runs of whitespace or non-whitespace longer than RUN_CHARS; the cuts can
# change ids, so the stand-in cuts at the same places.
PIECE_CHARS = 400_000
RUN_CHARS = 25_000


def remote_tokenizer_entry(path) -> str | None:
    """`module.Class` that the folder's tokenizer_config.json maps AutoTokenizer to, or None."""
    config = Path(path) / "tokenizer_config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") if config.is_file() else None
    except (OSError, ValueError):
        return None
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = [n for n in (entry if isinstance(entry, list) else [entry]) if isinstance(n, str) and n]
    return names[0] if names else None


def _literal(node: ast.expr):
    """A literal, or `"sep".join([literals])` (how Moonshot's class writes its pattern)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords):
        return node.func.value.value.join(ast.literal_eval(node.args[0]))
    return ast.literal_eval(node)


def class_constants(source: str, class_name: str) -> dict:
    """The literal class attributes of `class_name` in `source` (parsed, not run)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for stmt in node.body:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (
                    stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else None)
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = _literal(stmt.value)
                    except (ValueError, TypeError, SyntaxError):
                        pass
            return out
    return {}


def _pieces(text: str) -> Iterator[str]:
    """`text` cut where Moonshot's class cuts it: every PIECE_CHARS characters, then wherever a run of
    whitespace or of non-whitespace characters reaches RUN_CHARS + 1 (the cut starts a new run)."""
    for start in range(0, len(text), PIECE_CHARS):
        piece = text[start:start + PIECE_CHARS]
        begin, run, space = 0, 0, piece[:1].isspace()
        for i, ch in enumerate(piece):
            if ch.isspace() != space:
                space, run = not space, 1
                continue
            run += 1
            if run > RUN_CHARS:
                yield piece[begin:i]
                begin, run = i, 1
        yield piece[begin:]


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi's tiktoken tokenizer, built from a model folder's files, behaving as the folder's
    `tokenization_kimi.TikTokenTokenizer` does on transformers 5 (module doc). It has that class's
    name because it stands in for it: `check_remote_code_tokenizer` accepts the class the folder's
    `auto_map` names. `fallback_reason`: why the folder's own class was not used."""

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]
    fallback_reason: str | None = None

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, *, pat_str: str,
                 num_reserved_special_tokens: int = 256, **kwargs):
        import tiktoken

        if additional_special_tokens is None:
            additional_special_tokens = list(DEFAULT_ADDITIONAL_SPECIAL_TOKENS)
        self.vocab_file = vocab_file
        ranks = _read_ranks(Path(vocab_file))
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        first = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(first, first + num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            self.special_tokens.get(str(t)) for t in (bos_token, eos_token, pad_token, unk_token))
        to_char = _byte_to_char()
        self.byte_decoder = {c: b for b, c in to_char.items()}
        # every id, special ones included, as its bytes in byte-level characters; a later id wins a
        # shared string, as in Moonshot's class
        self.decoder = {i: "".join(to_char[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {token: i for i, token in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @classmethod
    def from_folder(cls, path, **kwargs) -> TikTokenTokenizer:
        """From a folder with tiktoken.model, tokenizer_config.json and the remote-code module its
        auto_map names (read for the pattern and the reserved count, not run)."""
        entry = remote_tokenizer_entry(path)
        if entry is None or "." not in entry:
            raise ValueError(f"{path}: tokenizer_config.json maps AutoTokenizer to no remote-code class")
        module, class_name = entry.rsplit(".", 1)
        source = Path(path) / f"{module.replace('.', '/')}.py"
        if not (Path(path) / VOCAB_FILE).is_file() or not source.is_file():
            raise ValueError(f"{path}: needs {VOCAB_FILE} and {source.name}")
        constants = class_constants(source.read_text(), class_name)
        pat_str = constants.get("pat_str")
        if not isinstance(pat_str, str):
            raise ValueError(f"{source}: no literal `pat_str` in class {class_name} (the pre-tokenization pattern)")
        reserved = constants.get("num_reserved_special_tokens", 256)
        return cls.from_pretrained(str(path), pat_str=pat_str, num_reserved_special_tokens=int(reserved), **kwargs)

    def encode(self, text, allow_special_tokens: bool = True, **kwargs) -> list[int]:
        # Moonshot's class: with any keyword, transformers' encode (added tokens split off, the rest
        # through _tokenize); without, tiktoken directly, special-token strings read as special tokens
        if kwargs:
            return super().encode(text, **kwargs)
        if type(text) is not str:
            raise TypeError(f"text must be str, not {type(text).__name__}")
        special = {"allowed_special": "all"} if allow_special_tokens else {"disallowed_special": ()}
        return [i for piece in _pieces(text) for i in self.model.encode(piece, **special)]

    def decode(self, token_ids, **kwargs) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if type(token_ids) is int else token_ids)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return self.encoder

    def _tokenize(self, text, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def convert_tokens_to_string(self, tokens) -> str:
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        import shutil

        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE)
        if out.resolve() != Path(self.vocab_file).resolve():
            shutil.copyfile(self.vocab_file, out)
        return (str(out),)


def load_tokenizer(path, trust_remote_code: bool = False):
    """The tokenizer of the model folder `path`: `AutoTokenizer.from_pretrained(path,
    trust_remote_code=...)`; when that fails in a folder whose AutoTokenizer is remote code over
    `tiktoken.model` (Kimi's), `TikTokenTokenizer.from_folder(path)` with a one-line note on stderr.
    Refuses, with the fix, when neither loads."""
    import transformers
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:
        entry = remote_tokenizer_entry(path) if trust_remote_code else None
        if entry is None or not (Path(path) / VOCAB_FILE).is_file():
            raise
        failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        try:
            tokenizer = TikTokenTokenizer.from_folder(path)
        except Exception as why:
            raise ValueError(
                f"{path}: its tokenizer code ({entry}) fails on transformers {transformers.__version__} ({failure}), "
                f"and no stand-in could be built from its files ({why}). Use a revision of the folder's "
                "tokenization_kimi.py that runs on transformers 5 (Moonshot's later revisions import bytes_to_unicode "
                "from transformers.convert_slow_tokenizer)") from err
    tokenizer.fallback_reason = f"{entry} fails on transformers {transformers.__version__} ({failure})"
    print(f"{path}: {tokenizer.fallback_reason}; using specforge_k25's TikTokenTokenizer built from the folder's "
          f"{VOCAB_FILE} and tokenizer_config.json instead (same ids)", file=sys.stderr)
    return tokenizer
