"""Which target layers the draft reads, and how to say that to SGLang and to vLLM.

Our one convention: a **capture point** p is an index into HF transformers'
`output_hidden_states` tuple, i.e. the residual stream entering decoder layer p
(= leaving layer p-1; 0 is the embedding output). K >= 0 points, strictly increasing, each in
[1, num_layers-1]; their number K is the number of aux states every batch carries (K*Ht wide).
K = 0 (`target.aux_layers=[]`, as an MTP-style head that reads only the final state asks; null is
the default three) captures nothing: the batches carry aux [N, 0] beside the final state [N, Ht],
and the SGLang engine then starts without EAGLE-3 capture (sglang_engine.py). Whether the draft
takes K states is the draft's business, checked in setup/target.py (capture_points).

SGLang 0.5.23 takes EAGLE-3 "layer ids" whose meaning depends on the model class
(`set_eagle3_layers_to_capture`): Llama captures the input of layer id+1; DeepseekV2/V3 (hence
Kimi-K2.5, which delegates to its DeepseekV3 language model) captures the input of layer `id`,
except that it adds 1 to every id when ids[0] == 1. The ids we pass at training time and write
into the exported `eagle_config` are derived here, so both capture the same points
(docs/EAGLE3.md §4).

vLLM (0.18 and later; read in its source: `SupportsEagle3` models' forward, e.g. llama.py and
deepseek_v2.py, which Kimi-K2.5's `KimiK25ForConditionalGeneration` delegates to) takes an id k
as the residual stream entering decoder layer k, 0 being the embedding output, for every model
family: its ids are our capture points themselves. It reads them from the draft config's
top-level `eagle_aux_hidden_state_layer_ids` (newer releases fall back to
`eagle_config.layer_ids`), never from SGLang's nested key first, so an export carries both.
"""
from __future__ import annotations

LLAMA_RULE = "llama"
DEEPSEEK_RULE = "deepseek"

_ARCH_RULES = {
    "LlamaForCausalLM": LLAMA_RULE,
    "DeepseekV3ForCausalLM": DEEPSEEK_RULE,
    "DeepseekV2ForCausalLM": DEEPSEEK_RULE,
    "KimiK25ForConditionalGeneration": DEEPSEEK_RULE,
}


def layer_id_rule(architecture: str) -> str:
    try:
        return _ARCH_RULES[architecture]
    except KeyError:
        raise ValueError(
            f"target architecture {architecture!r} is not supported; known: {sorted(_ARCH_RULES)}"
        ) from None


def default_capture_points(num_layers: int) -> list[int]:
    """SGLang's own default, [2, L//2, L-3] as layer inputs (Kimi-K2.5: [2, 30, 58])."""
    return [2, num_layers // 2, num_layers - 3]


def validate_capture_points(points: list[int], num_layers: int) -> list[int]:
    """`points` checked against a `num_layers`-layer target; [] (no capture point) is valid."""
    points = [int(p) for p in points]
    if not points:
        return []
    if len(set(points)) != len(points) or points != sorted(points):
        raise ValueError(f"target.aux_layers={points}: must be strictly increasing and distinct")
    if points[0] < 1 or points[-1] > num_layers - 1:
        raise ValueError(
            f"target.aux_layers={points}: each must be in [1, {num_layers - 1}] "
            f"(the input of a decoder layer of this {num_layers}-layer target)"
        )
    return points


def resolve_capture_points(aux_layers: list[int] | None, num_layers: int) -> list[int]:
    """`target.aux_layers` (null = the default) checked against the target: the one place a run's
    capture points are decided (the trainer's node and the TP-only nodes alike). An explicit [] is
    no capture point (K = 0), not the default: only None is."""
    return validate_capture_points(default_capture_points(num_layers) if aux_layers is None else aux_layers,
                                   num_layers)


def sglang_layer_ids(points: list[int], rule: str) -> list[int]:
    """Capture points -> the ids SGLang's `set_eagle3_layers_to_capture` needs to capture them
    ([] -> []: the engine then asks SGLang for no capture at all, sglang_engine.engine_server_args)."""
    if rule == LLAMA_RULE:
        return [p - 1 for p in points]
    if rule == DEEPSEEK_RULE:
        if points and points[0] == 1:
            raise ValueError(
                "SGLang's DeepSeek rule cannot capture the input of layer 1 first "
                "(ids starting with 1 are shifted by one); choose aux_layers starting at >= 2"
            )
        return list(points)
    raise ValueError(f"unknown layer id rule {rule!r}")


def capture_points_of_sglang_ids(ids: list[int], rule: str) -> list[int]:
    """What SGLang 0.5.23 captures for `ids` (mirror of its rule; tested against SGLang itself)."""
    if rule == LLAMA_RULE:
        return [i + 1 for i in ids]
    if rule == DEEPSEEK_RULE:
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    raise ValueError(f"unknown layer id rule {rule!r}")


def vllm_layer_ids(points: list[int]) -> list[int]:
    """Capture points -> the ids vLLM's EAGLE-3 capture needs (the same for Llama, DeepSeek, Kimi)."""
    return [int(p) for p in points]
