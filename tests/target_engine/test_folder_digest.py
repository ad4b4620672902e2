"""The target's digest (target_engine/folder_digest.py) over every weight format SGLang loads from a
folder: its DefaultModelLoader globs `*.safetensors`, then `*.bin` (load_format auto), `*.pt`
(load_format pt, or the fallback), with `model.safetensors.index.json` / `pytorch_model.bin.index.json`
beside them (sglang/srt/model_loader/loader.py, `_prepare_weights`). A fine-tune saved in any of them
is another target, so a resume of a run on the other is refused (train/fingerprint.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specforge_k25.target_engine.folder_digest import target_digest


def _save(tensors: dict, path: Path) -> None:
    """safetensors for *.safetensors, torch.save (pickle, as HF's pytorch_model*.bin) otherwise."""
    if path.suffix == ".safetensors":
        save_file(tensors, path)
    else:
        torch.save(tensors, path)


def _folder(path: Path, weights: str, seed: int) -> Path:
    """config.json, two shards of `weights`' format ({stem}-0000x-of-00002.{suffix}, as HF names
    them) and their index."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    g = torch.Generator().manual_seed(seed)
    stem, suffix = weights.rsplit(".", 1)
    names = [f"{stem}-0000{i}-of-00002.{suffix}" for i in (1, 2)]
    tensors = [{"model.embed_tokens.weight": torch.randn(32, 8, generator=g)}, {"lm_head.weight": torch.randn(32, 8, generator=g)}]
    for name, shard in zip(names, tensors):
        _save(shard, path / name)
    weight_map = {key: name for name, shard in zip(names, tensors) for key in shard}
    (path / f"{weights}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model.pt"])
def test_a_fine_tune_in_any_weight_format_has_another_digest(tmp_path, weights):
    base = target_digest(_folder(tmp_path / "base", weights, seed=0))
    assert target_digest(_folder(tmp_path / "copy", weights, seed=0)) == base  # same bytes, another folder
    assert target_digest(_folder(tmp_path / "tuned", weights, seed=1)) != base


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model.pt"])
def test_one_shard_changed_or_its_index_edited_changes_the_digest(tmp_path, weights):
    folder = _folder(tmp_path / "t", weights, seed=0)
    before = target_digest(folder)
    stem, suffix = weights.rsplit(".", 1)
    _save({"lm_head.weight": torch.zeros(32, 8)}, folder / f"{stem}-00002-of-00002.{suffix}")
    after_shard = target_digest(folder)
    assert after_shard != before
    index = folder / f"{weights}.index.json"
    index.write_text(index.read_text().replace("lm_head.weight", "lm_head.weight.moved"))
    assert target_digest(folder) != after_shard


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model.pt"])
def test_the_frozen_embedding_and_head_are_read_from_every_weight_format(tmp_path, weights):
    """A target SGLang loads is one our trainer reads: the embedding and lm_head rows come out of
    the `.bin` / `.pt` shards as they do out of safetensors (target_engine/hf_config.py)."""
    from specforge_k25.target_engine.hf_config import load_embedding_and_head

    folder = _folder(tmp_path / "t", weights, seed=3)
    g = torch.Generator().manual_seed(3)
    want_embed, want_head = torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g)
    (folder / f"{weights}.index.json").unlink()  # every file searched
    embed, head = load_embedding_and_head(folder)
    assert torch.equal(embed, want_embed) and torch.equal(head, want_head)
    _folder(tmp_path / "i", weights, seed=3)  # with the index: only the named shard is opened
    embed, head = load_embedding_and_head(tmp_path / "i")
    assert torch.equal(embed, want_embed) and torch.equal(head, want_head)
