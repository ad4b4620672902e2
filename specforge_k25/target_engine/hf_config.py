"""Read a target's config and its frozen embedding / lm_head without loading the model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .base import TargetInfo


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def read_target_info(model_path: str | Path) -> TargetInfo:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path={model_path}: no config.json (expected an HF-format model folder)")
    config = json.loads((path / "config.json").read_text())
    text = _text_config(config)
    return TargetInfo(
        architecture=config["architectures"][0],
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        bos_token_id=text.get("bos_token_id", config.get("bos_token_id")),
        eos_token_id=text.get("eos_token_id", config.get("eos_token_id")),
    )


def quantization_config(config: dict) -> dict | None:
    """The checkpoint's `quantization_config`: the top level's, else `text_config`'s (Kimi-K2.5 keeps
    it there; SGLang's KimiK25Config copies it to the top level)."""
    return config.get("quantization_config") or _text_config(config).get("quantization_config")


def _find_tensor(path: Path, names: list[str]) -> torch.Tensor | None:
    """The first of `names` in the folder's weights. With a `model.safetensors.index.json` only
    the shard its weight map names is opened (a name it lacks is not in the checkpoint: Kimi-K2.5's
    64 shards are 595 GB, and the plain names are looked up before the `language_model.` ones);
    without one, every file is searched. A folder without safetensors is read from the pickled
    formats SGLang also loads (`pytorch_model*.bin` with its index, `*.pt`), memory-mapped."""
    for index_name, pattern, read in (("model.safetensors.index.json", "*.safetensors", _read_safetensors),
                                      ("pytorch_model.bin.index.json", "*.bin", _read_pickled),
                                      (None, "*.pt", _read_pickled)):
        index = path / index_name if index_name else None
        weight_map = json.loads(index.read_text())["weight_map"] if index is not None and index.is_file() else None
        files = sorted(path.glob(pattern))
        if weight_map is None and not files:
            continue
        for name in names:
            candidates = ([path / weight_map[name]] if name in weight_map else []) if weight_map is not None else files
            for file in candidates:
                tensor = read(file, name)
                if tensor is not None:
                    return tensor
        return None  # the folder's weights are in this format: the name is not among them
    return None


def _read_safetensors(file: Path, name: str) -> torch.Tensor | None:
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name) if name in f.keys() else None


def _read_pickled(file: Path, name: str) -> torch.Tensor | None:
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return state.get(name)


def load_embedding_and_head(model_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, Ht], lm_head [V, Ht]) read tensor-by-tensor from the weight shards.

    Handles the multimodal `language_model.` prefix (Kimi-K2.5) and tied embeddings.
    """
    path = Path(model_path)
    prefixes = ["", "language_model."]
    embed = _find_tensor(path, [p + "model.embed_tokens.weight" for p in prefixes])
    if embed is None:
        raise KeyError(f"{model_path}: no model.embed_tokens.weight in its weight files")
    head = _find_tensor(path, [p + "lm_head.weight" for p in prefixes])
    if head is None:
        config = json.loads((path / "config.json").read_text())
        if not _text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            raise KeyError(f"{model_path}: no lm_head.weight and embeddings are not tied")
        head = embed
    return embed, head
