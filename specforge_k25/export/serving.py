"""Write a trained draft as the folder SGLang and vLLM load as is, check such a folder, and load it
back, for every draft method (draft/registry.py): the method builds its config and tensors, this
module gives it what only the target knows (docs/EAGLE3.md §5).

  * layer ids, written once per server because the two number them differently
    (target_engine/layers.py): SGLang's per-model ids, vLLM's = the capture points;
  * `eos_token_id` as served (`served_eos`).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..draft.export_folder import publish_folder
from ..draft.registry import method_of, method_of_export
from ..target_engine.layers import vllm_layer_ids


def served_eos(eos_token_id, end_of_turn_id: int | None = None):
    """The `eos_token_id` an export writes: the ids the served model stops at. A chat target whose
    turns end with their own token (Kimi-K2.5: `<|im_end|>` 163586, while its config's eos is
    [EOS] 163585) gets that token first, then the config's eos ids; without one, the config's eos."""
    if end_of_turn_id is None:
        return eos_token_id
    rest = eos_token_id if isinstance(eos_token_id, list) else [] if eos_token_id is None else [eos_token_id]
    rest = [i for i in rest if i != end_of_turn_id]
    return [int(end_of_turn_id), *rest] if rest else int(end_of_turn_id)


def export_draft(draft: nn.Module, out_dir: str | Path, sglang_capture_ids: list[int], bos_token_id, eos_token_id,
                 dtype: torch.dtype = torch.float32, *, capture_points: list[int],
                 end_of_turn_id: int | None = None) -> Path:
    """Atomically write <out_dir>/{config.json, model.safetensors}; no embedding (the server shares the target's).

    `sglang_capture_ids` are SGLang's ids (`target_engine.layers.sglang_layer_ids`), `capture_points`
    the layer inputs they capture; the vLLM ids are derived from the latter. `end_of_turn_id`
    (target.end_of_turn_token's id) goes first in the written `eos_token_id` (`served_eos`).
    """
    method = method_of(draft)
    config = method.serving_config(draft.cfg, sglang_layer_ids=list(sglang_capture_ids),
                                   vllm_layer_ids=vllm_layer_ids(capture_points), bos_token_id=bos_token_id,
                                   eos_token_id=served_eos(eos_token_id, end_of_turn_id),
                                   dtype=str(dtype).replace("torch.", ""))
    return publish_folder(out_dir, method.serving_tensors(draft, dtype), config, method.validate_export)


def validate_export(export_dir: str | Path) -> None:
    """Raise ValueError listing every way the folder differs from what SGLang's and vLLM's loaders expect."""
    method_of_export(export_dir).validate_export(Path(export_dir))


def load_exported_draft(export_dir: str | Path, embed_weight: torch.Tensor, lm_head: torch.Tensor | None = None) -> nn.Module:
    """Rebuild the draft (of whichever method wrote the folder) plus the target's embedding [V, H]
    and, given, its lm_head [V, Ht] (DFlash computes its logits with it; the EAGLE-3 heads have their own)."""
    return method_of_export(export_dir).load(Path(export_dir), embed_weight, lm_head)
