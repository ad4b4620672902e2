"""`draft=eagle3_mla`: the EAGLE-3 head with DeepSeek multi-latent attention
(draft/eagle3_mla/model.py) trained with the same TTT objective, served as
`Eagle3DeepseekV2ForCausalLM` (SGLang's kimi_k25_eagle3.py, vLLM's deepseek_eagle3.py); its
knobs: draft/eagle3_mla/config.py."""
from __future__ import annotations

from ..eagle3.method import Eagle3Method, check_draft_vocab
from . import export, plan
from .config import Eagle3MLASpec
from .model import Eagle3MLADraft, MLADraftConfig



class Eagle3MLAMethod(Eagle3Method):
    name = "eagle3_mla"
    summary = "EAGLE-3 head, DeepSeek MLA attention (Eagle3DeepseekV2ForCausalLM), trained with TTT"
    served_architecture = export.ARCHITECTURE
    sglang_algorithm = "EAGLE3"
    model_class = Eagle3MLADraft
    config_class = MLADraftConfig
    spec_class = Eagle3MLASpec  # draft.* (conf group option `draft=eagle3_mla`)
    plan = plan
    export = export
    _units = ("fc", "midlayer", "norm", "lm_head")
    config_recorded_later = {}  # its config has no EAGLE-3.1 options

    def resolve_config(self, spec: Eagle3MLASpec, target, num_aux: int) -> MLADraftConfig:
        """Unset MLA sizes follow an MLA target (Kimi-K2.5: q_lora_rank 1536, kv_lora_rank 512,
        nope/rope/v head dims 128/64/128); behind a GQA/MHA target (head dim hd) they take
        Kimi's ratios: nope hd, rope hd/2, v hd, kv_lora_rank 4hd, q_lora_rank 12hd.
        RoPE is plain (YaRN factor 1, written as such): the head sees draft-length contexts."""
        check_draft_vocab(spec, target)
        if num_aux < 1:
            raise ValueError(f"{num_aux} capture points (target.aux_layers), but the MLA EAGLE-3 head reads at least "
                             f"one (its fc is K x Ht wide): give one or more, or null for the default")
        heads = spec.num_attention_heads or target.num_attention_heads
        hd = spec.head_dim or target.hidden_size // heads
        mla = target.kv_lora_rank is not None

        def pick(name: str, target_value, fallback: int) -> int:
            value = getattr(spec, name)
            return value if value is not None else (target_value if mla and target_value else fallback)

        return MLADraftConfig(
            hidden_size=target.hidden_size, intermediate_size=spec.intermediate_size or target.intermediate_size,
            num_attention_heads=heads,
            q_lora_rank=pick("q_lora_rank", target.q_lora_rank, 12 * hd),
            kv_lora_rank=pick("kv_lora_rank", target.kv_lora_rank, 4 * hd),
            qk_nope_head_dim=pick("qk_nope_head_dim", target.qk_nope_head_dim, hd),
            qk_rope_head_dim=pick("qk_rope_head_dim", target.qk_rope_head_dim, max(2, hd // 2)),
            v_head_dim=pick("v_head_dim", target.v_head_dim, hd),
            vocab_size=target.vocab_size, draft_vocab_size=spec.vocab_size, target_hidden_size=target.hidden_size,
            num_aux_hidden_states=num_aux, rms_norm_eps=target.rms_norm_eps, rope_theta=spec.rope_theta,
            max_position_embeddings=spec.max_position_embeddings or target.max_position_embeddings,
        )

    def num_aux(self, cfg: MLADraftConfig) -> int:
        return cfg.num_aux_hidden_states

    def describe(self, cfg: MLADraftConfig) -> str:
        return (f"EAGLE-3, MLA attention: H {cfg.hidden_size}, {cfg.num_attention_heads} heads, q_lora "
                f"{cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, nope/rope/v {cfg.qk_nope_head_dim}/"
                f"{cfg.qk_rope_head_dim}/{cfg.v_head_dim}, I {cfg.intermediate_size}, Vd {cfg.draft_vocab_size}, "
                f"K {cfg.num_aux_hidden_states}")
