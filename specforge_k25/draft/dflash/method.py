"""`draft.method=dflash`: block drafting (draft/dflash/model.py) trained with random-anchor blocks
(draft/dflash/loss.py), served as `DFlashDraftModel` (SGLang speculative_algorithm DFLASH, vLLM
method `dflash`).

Config fields (config.py DraftConfigSpec; read with getattr defaults, so a bare namespace works):
  block_size (8), num_layers (null = K, one draft layer per capture point, SGLang's and z-lab's
  default pairing), num_anchors (512 per sequence), loss_gamma (null: 7 for blocks >= 16, 5 for
  >= 10, else 4), mask_token_id (null = the tokenizer's highest unused special token, else V-1), logits_chunk (2048),
  attention_tile_rows / attention_tile_keys (512 / 1024: the block attention's score tile); and the shared sizes
  (num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rope_theta,
  max_position_embeddings). draft.vocab_size is not used: the draft proposes over the full
  target vocab with the target's lm_head.

Mask token rule: an id below the target vocab (SGLang refuses another) that real input never
contains. The default V-1 is the last embedding row: for Kimi-K2.5 a reserved special token, for
padded vocabularies a padding row. Setup (setup/run.py) refuses data containing it: it asks every
method for its `reserved_token_ids`.

What the trainer asks of it beyond the EAGLE-3 methods (draft/method.py):
  needs_teacher = False  the loss is CE against the sequence's own tokens: no teacher logits
  depth                  block_size - 1 (block positions 1..B-1), whatever train.ttt_length says;
                         train.loss_decay is not used (cfg.loss_gamma weights the positions)
  prepare_batch          the anchors, from the trainer's generator (seeded per schedule item, so a
                         resume draws the same), into `batch.draws`; loss and loss_positions need them
  attach_target          the target's lm_head (the logits are computed with it)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..method import DraftBatch, DraftMethod, Serving
from . import export, plan
from . import loss as block_loss
from .model import DFlashConfig, DFlashDraft
from .replay import block_proposals

DEFAULT_BLOCK_SIZE = 8
DEFAULT_NUM_ANCHORS = 512


def default_gamma(block_size: int) -> float:
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


class DFlashMethod(DraftMethod):
    name = "dflash"
    served_architecture = export.ARCHITECTURE
    sglang_algorithm = "DFLASH"
    vllm_method = "dflash"
    model_class = DFlashDraft
    config_class = DFlashConfig  # what resolve_config returns (registry.method_of_config)
    plan = plan
    needs_teacher = False  # CE against the sequence's own tokens
    # the loss's logits chunk and the block attention's tile: the same sums, computed in pieces
    memory_only = ("logits_chunk", "attention_tile_rows", "attention_tile_keys")

    def resolve_config(self, spec, target, num_aux: int = 5) -> DFlashConfig:
        if num_aux < 1:
            raise ValueError("DFlash reads at least one capture point")
        block = getattr(spec, "block_size", None) or DEFAULT_BLOCK_SIZE
        heads = getattr(spec, "num_attention_heads", None) or target.num_attention_heads
        kv_heads = getattr(spec, "num_key_value_heads", None) or target.num_key_value_heads or heads
        if heads % kv_heads:  # e.g. an MLA target reports as many KV heads as heads
            kv_heads = heads
        mask = getattr(spec, "mask_token_id", None)
        gamma = getattr(spec, "loss_gamma", None)
        return DFlashConfig(
            hidden_size=target.hidden_size,
            intermediate_size=getattr(spec, "intermediate_size", None) or target.intermediate_size,
            num_hidden_layers=getattr(spec, "num_layers", None) or num_aux,
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=getattr(spec, "head_dim", None) or target.hidden_size // heads,
            vocab_size=target.vocab_size, target_hidden_size=target.hidden_size, num_aux_hidden_states=num_aux,
            block_size=block, mask_token_id=target.vocab_size - 1 if mask is None else mask,
            rms_norm_eps=target.rms_norm_eps, rope_theta=getattr(spec, "rope_theta", 10000.0),
            max_position_embeddings=getattr(spec, "max_position_embeddings", None) or target.max_position_embeddings,
            num_anchors=getattr(spec, "num_anchors", None) or DEFAULT_NUM_ANCHORS,
            loss_gamma=gamma if gamma is not None else default_gamma(block),
            logits_chunk=getattr(spec, "logits_chunk", None) or 2048,
            # the block attention's tile (model.py); no draft.* field yet, so the defaults unless a spec sets them
            attention_tile_rows=getattr(spec, "attention_tile_rows", None) or DFlashConfig.attention_tile_rows,
            attention_tile_keys=getattr(spec, "attention_tile_keys", None) or DFlashConfig.attention_tile_keys,
        )

    def num_aux(self, cfg: DFlashConfig) -> int:
        return cfg.num_aux_hidden_states

    def build(self, cfg: DFlashConfig) -> DFlashDraft:
        return DFlashDraft(cfg)

    def attach_target(self, model: DFlashDraft, lm_head: torch.Tensor) -> None:
        model.attach_lm_head(lm_head)

    def reserved_token_ids(self, cfg: DFlashConfig) -> list[int]:
        return [cfg.mask_token_id]

    def with_unused_special_tokens(self, spec, unused: list[int]):
        # a special token the data never holds cannot come from rendered text (rows with special-token
        # text are skipped) and a target rarely generates it; vocab - 1 may be an ordinary word
        # (SmolLM2's 49151 is "ectable"). The highest such id: tokenizers put reserved tokens last.
        if getattr(spec, "mask_token_id", None) is None and unused:
            return replace(spec, mask_token_id=unused[-1])
        return spec

    def fsdp_units(self, model) -> list[str]:
        return ["fc", "hidden_norm", *[f"layers.{i}" for i in range(len(model.layers))], "norm"]

    def describe(self, cfg: DFlashConfig) -> str:
        return (f"DFlash: {cfg.num_hidden_layers} layers, H {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                f"{cfg.num_key_value_heads} x {cfg.head_dim}, I {cfg.intermediate_size}, K {cfg.num_aux_hidden_states}, "
                f"block {cfg.block_size}, mask id {cfg.mask_token_id}, {cfg.num_anchors} anchors, gamma {cfg.loss_gamma:g}")

    # --------------------------------------------------------------- training
    def depth(self, cfg: DFlashConfig, ttt_length: int) -> int:
        """Block positions 1..B-1: train.ttt_length does not apply."""
        return cfg.block_size - 1

    def prepare_batch(self, cfg: DFlashConfig, batch: DraftBatch, generator: torch.Generator) -> DraftBatch:
        """Draw the batch's anchors from the trainer's generator (before loss_positions and loss)."""
        batch.draws = block_loss.sample_anchors(batch.loss_mask, batch.lengths, cfg.num_anchors, generator)
        return batch

    @staticmethod
    def _anchors(batch: DraftBatch):
        if batch is None or batch.draws is None:
            raise ValueError("DFlash draws its anchors per batch: call method.prepare_batch(cfg, batch, generator) "
                             "before loss_positions and loss")
        return batch.draws

    def _check_depth(self, cfg: DFlashConfig, depth: int) -> None:
        if depth != cfg.block_size - 1:
            raise ValueError(f"DFlash counts block positions 1..{cfg.block_size - 1}: depth must be "
                             f"block_size - 1 = {cfg.block_size - 1} (method.depth), got {depth}")

    def loss(self, model, batch: DraftBatch, *, depth: int, decay: float = 0.0, normalizer=None, checkpoint: bool = False):
        """`decay` is EAGLE's; DFlash weights block positions by cfg.loss_gamma."""
        cfg = model.cfg
        self._check_depth(cfg, depth)
        anchors, valid = self._anchors(batch)
        return block_loss.dflash_loss(model, batch.aux_hidden, batch.input_ids, batch.loss_mask, batch.lengths,
                                      anchors, valid, normalizer=normalizer, checkpoint=checkpoint)

    def loss_positions(self, batch: DraftBatch, depth: int) -> torch.Tensor:
        anchors, valid = self._anchors(batch)
        return block_loss.loss_positions(batch.loss_mask, batch.lengths, anchors, valid, depth + 1)

    # ----------------------------------------------------------------- export
    def serving_tensors(self, model, dtype):
        return export.serving_tensors(model, dtype)

    def serving_config(self, cfg, *, sglang_layer_ids, vllm_layer_ids, bos_token_id, eos_token_id, dtype) -> dict:
        """`sglang_layer_ids` (the EAGLE-3 rule's) are not used: DFlash's SGLang ids are capture
        point - 1 for every family, derived from vLLM's (= the capture points)."""
        return export.serving_config(cfg, vllm_layer_ids, bos_token_id, eos_token_id, dtype)

    def validate_export(self, export_dir: Path) -> None:
        export.validate_export(export_dir)

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor, lm_head: torch.Tensor | None = None) -> DFlashDraft:
        return export.load_export(export_dir, embed_weight, lm_head)

    # ------------------------------------------------------------------ serve
    def servings(self, chains: list) -> list[Serving]:
        """One block size per distinct `num_draft_tokens` of the chains (the last accepted token +
        size-1 drafts, one draft forward per verify step): SGLang's speculative_num_draft_tokens is
        the block size and it forces steps 1 / topk 1; vLLM (0.20+) reads no block size from the
        export: it must be started with num_speculative_tokens = size - 1, or it serves another length."""
        sizes = list(dict.fromkeys(int(draft_tokens) for _steps, _topk, draft_tokens in chains))
        for size in sizes:
            if size < 2:
                raise ValueError(f"block size {size}: a block holds the last token and at least one draft")
        return [Serving(f"block {size}", size, size - 1,
                        {"speculative_algorithm": self.sglang_algorithm, "speculative_num_steps": 1,
                         "speculative_eagle_topk": 1, "speculative_num_draft_tokens": size},
                        {"method": self.vllm_method, "num_speculative_tokens": size - 1}) for size in sizes]

    def proposals(self, model, aux_hidden, input_ids, servings: list[Serving]) -> list[torch.Tensor]:
        """One pass per block size: a block attends both ways, so a longer block changes the earlier proposals."""
        return [block_proposals(model, aux_hidden, input_ids, s.draft_tokens) for s in servings]
