"""`draft=eagle3`: the Llama-style EAGLE-3 head (draft/eagle3/model.py) trained with TTT
(draft/eagle3/loss.py), served as `LlamaForCausalLMEagle3` (SGLang, vLLM), with the EAGLE-3.1 options
`draft.fc_norm` and `draft.norm_output`; its knobs: draft/eagle3/config.py."""
from __future__ import annotations

from pathlib import Path

import torch

from . import loss as ttt
from ..method import DraftBatch, DraftMethod, Serving
from .model import NUM_AUX, DraftConfig, Eagle3Draft
from . import export, plan
from .config import Eagle3Spec, TTTSpec
from .replay import chain_proposals


class Eagle3Method(DraftMethod):
    name = "eagle3"
    summary = "EAGLE-3 head, Llama attention (LlamaForCausalLMEagle3), trained with TTT; EAGLE-3.1 options"
    served_architecture = "LlamaForCausalLMEagle3"
    sglang_algorithm = "EAGLE3"
    vllm_method = "eagle3"
    model_class = Eagle3Draft
    config_class = DraftConfig
    spec_class = Eagle3Spec  # draft.* (conf group option `draft=eagle3`)
    plan = plan
    export = export  # the serving folder's module: tensors, config, check, reload
    _units = ("fc_norm", "fc", "midlayer", "norm", "lm_head")  # fc_norm exists only with the option on
    context_parallel = True  # train/context_parallel.py: Ulysses attention, the TTT loss cut to each rank's window
    config_recorded_later = {"fc_norm": False, "norm_output": False}  # the EAGLE-3.1 options, off before them
    plan_label = "TTT"  # the plan sizes its unroll's steps

    def resolve_config(self, spec: Eagle3Spec, target, num_aux: int) -> DraftConfig:
        """H = Ht (the draft embeds tokens with the target's frozen embedding); unset sizes follow
        the target; an MLA target's heads become MHA heads of hidden/heads."""
        check_draft_vocab(spec, target)
        if num_aux != NUM_AUX:
            raise ValueError(f"{num_aux} capture points (target.aux_layers), but the EAGLE-3 head (fc over "
                             f"{NUM_AUX} x Ht, as SGLang and vLLM build it) takes exactly {NUM_AUX}: give "
                             f"{NUM_AUX} capture points or null for the default")
        heads = spec.num_attention_heads or target.num_attention_heads
        kv_heads = spec.num_key_value_heads or target.num_key_value_heads or heads
        if heads % kv_heads:  # e.g. MLA targets report as many KV heads as heads: fall back to MHA
            kv_heads = heads
        return DraftConfig(
            hidden_size=target.hidden_size, intermediate_size=spec.intermediate_size or target.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=spec.head_dim or target.hidden_size // heads,
            vocab_size=target.vocab_size, draft_vocab_size=spec.vocab_size, target_hidden_size=target.hidden_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=spec.rope_theta,
            max_position_embeddings=spec.max_position_embeddings or target.max_position_embeddings,
            fc_norm=spec.fc_norm, norm_output=spec.norm_output,
        )

    def num_aux(self, cfg) -> int:
        return NUM_AUX

    def new_model(self, cfg) -> Eagle3Draft:
        return self.model_class(cfg)

    def describe(self, cfg) -> str:
        options = [o for o in ("fc_norm", "norm_output") if getattr(cfg, o, False)]
        return (f"EAGLE-3, Llama attention: H {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                f"{cfg.num_key_value_heads} x {cfg.head_dim}, I {cfg.intermediate_size}, Vd {cfg.draft_vocab_size}"
                + (f", EAGLE-3.1 {' + '.join(options)}" if options else ""))

    def init_from_target(self, model, spec: TTTSpec, lm_head: torch.Tensor) -> None:
        """draft.head_from_target: draft token i's lm_head row = the target's row of its token
        (i + d2t[i]), so the head starts with the target's output geometry; the draft's final norm
        keeps its ones (the target's final norm is not among the frozen pieces it receives)."""
        if not spec.head_from_target:
            return
        if lm_head.shape[1] != model.lm_head.weight.shape[1]:
            raise ValueError(f"draft.head_from_target: the target's lm_head is {lm_head.shape[1]} wide, the "
                             f"draft's {model.lm_head.weight.shape[1]}; turn it off for this draft")
        rows = torch.arange(model.d2t.numel(), device=model.d2t.device) + model.d2t
        with torch.no_grad():
            model.lm_head.weight.copy_(lm_head[rows.to(lm_head.device)].to(model.lm_head.weight))

    def fsdp_units(self, model) -> list[str]:
        return [u for u in self._units if hasattr(model, u)]

    def depth(self, spec: TTTSpec, cfg) -> int:
        """The TTT unroll, draft.ttt_length."""
        return spec.ttt_length

    def objective_fingerprint(self, spec: TTTSpec) -> dict:
        return {"ttt_length": spec.ttt_length, "loss_decay": spec.loss_decay}

    def loss(self, model, batch: DraftBatch, spec: TTTSpec, *, depth: int, normalizer=None, checkpoint: bool = False):
        return ttt.ttt_loss(model, batch.aux_hidden, batch.input_ids, batch.loss_mask, batch.lengths, batch.teacher,
                            depth, spec.loss_decay, normalizer, checkpoint=checkpoint, seq=batch.seq)

    def loss_positions(self, batch: DraftBatch, depth: int) -> torch.Tensor:
        return ttt.loss_positions(batch.loss_mask, batch.lengths, batch.teacher, depth, batch.seq)

    def serving_tensors(self, model, dtype):
        return self.export.serving_tensors(model, dtype)

    def serving_config(self, cfg, *, sglang_layer_ids, vllm_layer_ids, bos_token_id, eos_token_id, dtype) -> dict:
        return self.export.serving_config(cfg, sglang_layer_ids, vllm_layer_ids, bos_token_id, eos_token_id, dtype)

    def validate_export(self, export_dir: Path) -> None:
        self.export.validate_export(export_dir)

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor) -> Eagle3Draft:
        return self.export.load_export(export_dir, embed_weight)

    # ------------------------------------------------------------------ serve
    def proposals(self, model, aux_hidden, input_ids, servings: list[Serving], final_hidden=None) -> list[torch.Tensor]:
        """One chain as deep as the deepest serving; a shallower chain proposes its first steps."""
        deepest = chain_proposals(model, aux_hidden, input_ids, max(s.depth for s in servings))
        return [deepest[: s.depth] for s in servings]


def check_draft_vocab(spec: TTTSpec, target) -> None:
    if spec.vocab_size > target.vocab_size:
        raise ValueError(f"draft.vocab_size={spec.vocab_size} exceeds the target vocab {target.vocab_size}")
