"""`draft=dflash`: block drafting (draft/dflash/model.py) trained with random-anchor blocks
(draft/dflash/loss.py), served as `DFlashDraftModel` (SGLang speculative_algorithm DFLASH, vLLM
method `dflash`). Its knobs and their defaults: draft/dflash/config.py `DFlashSpec`. It proposes
over the full target vocab with the target's lm_head: there is no draft vocabulary.

Mask token rule: an id below the target vocab (SGLang refuses another) that real input never
contains. The default V-1 is the last embedding row: for Kimi-K2.5 a reserved special token, for
padded vocabularies a padding row. Setup (setup/data_checks.py) refuses data containing it: it asks every
method for its `reserved_tokens`.

What the trainer asks of it beyond the EAGLE-3 methods (draft/method.py):
  needs_teacher = False  the loss is CE against the sequence's own tokens: no teacher logits
  depth                  block_size - 1 (block positions 1..B-1); cfg.loss_gamma weights the positions
  prepare_batch          the anchors, from the trainer's generator (seeded per schedule item, so a
                         resume draws the same), into `batch.draws`; loss and loss_positions need them
  attach_target          the target's lm_head (the logits are computed with it); co-located, this
                         rank's rows of it (shards_target_head, train/vocab_parallel.py)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..method import DraftBatch, DraftMethod, Serving
from . import export, plan
from . import loss as block_loss
from .config import DFlashSpec, default_gamma
from .model import DFlashConfig, DFlashDraft
from .replay import block_proposals


class DFlashMethod(DraftMethod):
    name = "dflash"
    summary = "DFlash block drafter (DFlashDraftModel); train it with data.regenerate=true"
    served_architecture = export.ARCHITECTURE
    sglang_algorithm = "DFLASH"
    vllm_method = "dflash"
    model_class = DFlashDraft
    spec_class = DFlashSpec  # draft.* (conf group option `draft=dflash`)
    keep_units_gathered = False  # each layer runs once per forward: free it after its forward and backward
    shards_target_head = True  # co-located: 1/W of the lm_head per rank, the loss's logits computed together
    config_class = DFlashConfig  # what resolve_config returns (registry.method_of_config)
    plan = plan
    needs_teacher = False  # CE against the sequence's own tokens; with draft.distill its loss computes the
    # target's distribution itself, only at the rows it counts, from the final states
    needs_final_hidden = True  # draft.distill's teacher (the stream carries the final states anyway)
    # hw.context_parallel: a rank runs the blocks anchored in its window of the positions, and each
    # layer gathers the context's keys and values of the whole sequence (model.py)
    context_parallel = True
    # the loss's logits chunk and the block attention's tile: the same sums, computed in pieces
    memory_only = ("logits_chunk", "attention_tile_rows", "attention_tile_keys")
    plan_label = "DFlash"  # the plan's steps are its draft layers

    def resolve_config(self, spec: DFlashSpec, target, num_aux: int) -> DFlashConfig:
        if num_aux < 1:
            raise ValueError("DFlash reads at least one capture point")
        check_objective(spec)
        heads = spec.num_attention_heads or target.num_attention_heads
        kv_heads = spec.num_key_value_heads or target.num_key_value_heads or heads
        if heads % kv_heads:  # e.g. an MLA target reports as many KV heads as heads
            kv_heads = heads
        return DFlashConfig(
            hidden_size=target.hidden_size, intermediate_size=spec.intermediate_size or target.intermediate_size,
            num_hidden_layers=spec.num_layers or num_aux, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=spec.head_dim or target.hidden_size // heads,
            vocab_size=target.vocab_size, target_hidden_size=target.hidden_size, num_aux_hidden_states=num_aux,
            block_size=spec.block_size,
            mask_token_id=target.vocab_size - 1 if spec.mask_token_id is None else spec.mask_token_id,
            rms_norm_eps=target.rms_norm_eps, rope_theta=spec.rope_theta,
            max_position_embeddings=spec.max_position_embeddings or target.max_position_embeddings,
            num_anchors=spec.num_anchors,
            loss_gamma=spec.loss_gamma if spec.loss_gamma is not None else default_gamma(spec.block_size),
            logits_chunk=spec.logits_chunk, attention_tile_rows=spec.attention_tile_rows,
            attention_tile_keys=spec.attention_tile_keys,
        )

    def num_aux(self, cfg: DFlashConfig) -> int:
        return cfg.num_aux_hidden_states

    def new_model(self, cfg: DFlashConfig) -> DFlashDraft:
        return DFlashDraft(cfg)

    def attach_target(self, model: DFlashDraft, lm_head: torch.Tensor) -> None:
        model.attach_lm_head(lm_head)

    def reserved_tokens(self, cfg: DFlashConfig) -> dict[str, int]:
        return {"draft.mask_token_id": cfg.mask_token_id}

    def with_unused_special_tokens(self, spec, unused: list[int]):
        # a special token the data never holds cannot come from rendered text (rows with special-token
        # text are skipped) and a target rarely generates it; vocab - 1 may be an ordinary word
        # (SmolLM2's 49151 is "ectable"). The highest such id: tokenizers put reserved tokens last.
        if spec.mask_token_id is None and unused:
            return replace(spec, mask_token_id=unused[-1])
        return spec

    def fsdp_units(self, model) -> list[str]:
        return ["fc", "hidden_norm", *[f"layers.{i}" for i in range(len(model.layers))], "norm"]

    def describe(self, cfg: DFlashConfig) -> str:
        return (f"DFlash: {cfg.num_hidden_layers} layers, H {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                f"{cfg.num_key_value_heads} x {cfg.head_dim}, I {cfg.intermediate_size}, K {cfg.num_aux_hidden_states}, "
                f"block {cfg.block_size}, mask id {cfg.mask_token_id}, {cfg.num_anchors} anchors, gamma {cfg.loss_gamma:g}")

    # --------------------------------------------------------------- training
    def depth(self, spec: DFlashSpec, cfg: DFlashConfig) -> int:
        """Block positions 1..B-1."""
        return cfg.block_size - 1

    def prepare_batch(self, cfg: DFlashConfig, batch: DraftBatch, generator: torch.Generator) -> DraftBatch:
        """Draw the batch's anchors, each sequence's from its own seed (batch.seeds) when given, else
        from the trainer's generator (before loss_positions and loss);
        with context parallelism (batch.seq) over the whole sequences, kept valid in this rank's window."""
        draws = ([torch.Generator().manual_seed(s) for s in batch.seeds] if batch.seeds is not None else generator)
        anchors, valid = block_loss.sample_anchors(batch.loss_mask, batch.lengths, cfg.num_anchors, draws)
        if batch.seq is not None:
            valid = block_loss.window_anchors(anchors, valid, batch.seq.start, batch.seq.length)
        batch.draws = anchors, valid
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

    def objective_fingerprint(self, spec: DFlashSpec) -> dict:
        """draft.loss_weights and draft.distill, recorded only when set: a checkpoint from before
        they existed trained without them, and resumes as long as they stay unset."""
        weights, distill = objective(spec)
        return {**({"loss_weights": [float(w) for w in weights]} if weights is not None else {}),
                **({"distill": float(distill)} if distill else {})}

    def loss(self, model, batch: DraftBatch, spec: DFlashSpec, *, depth: int, normalizer=None, checkpoint: bool = False):
        """Block positions weighted by draft.loss_weights or cfg.loss_gamma; draft.distill's share
        of soft CE against the target's distribution (from batch.final_hidden)."""
        cfg = model.cfg
        self._check_depth(cfg, depth)
        anchors, valid = self._anchors(batch)
        weights, distill = objective(spec)
        return block_loss.dflash_loss(model, batch.aux_hidden, batch.input_ids, batch.loss_mask, batch.lengths,
                                      anchors, valid, normalizer=normalizer, checkpoint=checkpoint,
                                      weights=weights, distill=distill,
                                      final_hidden=batch.final_hidden if distill else None, seq=batch.seq)

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

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor) -> DFlashDraft:
        return export.load_export(export_dir, embed_weight)

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

    def proposals(self, model, aux_hidden, input_ids, servings: list[Serving], final_hidden=None) -> list[torch.Tensor]:
        """One pass per block size: a block attends both ways, so a longer block changes the earlier proposals."""
        return [block_proposals(model, aux_hidden, input_ids, s.draft_tokens) for s in servings]


def objective(spec) -> tuple[list | None, float]:
    """(draft.loss_weights, draft.distill); their defaults for a spec without them (a caller that
    hands the loss another method's spec, as tests of the shared training loop do)."""
    return getattr(spec, "loss_weights", None), float(getattr(spec, "distill", 0.0))


def check_objective(spec: DFlashSpec) -> None:
    """ValueError naming the objective field out of its range."""
    if not 0 <= spec.distill <= 1:
        raise ValueError(f"draft.distill={spec.distill}: the soft-CE share is between 0 and 1")
    if spec.loss_weights is not None:
        weights = list(spec.loss_weights)
        if len(weights) != spec.block_size - 1 or any(not float(w) > 0 for w in weights):
            raise ValueError(f"draft.loss_weights={weights}: give block_size - 1 = {spec.block_size - 1} weights > 0, "
                             f"one per drafted block position")
