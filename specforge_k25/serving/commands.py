"""The serving commands of the best settings: SGLang's flags and vLLM's `speculative_config`,
with vLLM's per-batch-size schedule of drafted tokens.

vLLM's schedule: `num_speculative_tokens_per_batch_size`, a list of inclusive
[batch_start, batch_end, num_speculative_tokens] ranges, the first starting at 1, K >= 0, each
capped at `num_speculative_tokens` (vLLM 0.24.0 is the first release that has it:
vllm/config/speculative.py ~162 and vllm/v1/spec_decode/dynamic/utils.py ~52 of its source
distribution; 0.20.0-0.23.0 do not). Later releases also take 5-item entries with context ranges;
the 3-item form is emitted here.
"""
from __future__ import annotations

from ..draft.registry import get_method
from .predict import NGRAM, Prediction, Setting

VLLM_SCHEDULE_VERSION = "0.24.0"


def sglang_flags(setting: Setting) -> str:
    """SGLang 0.5.23 server flags of a setting (the draft path as DRAFT: the export folder)."""
    if setting.method == NGRAM:
        # breadth 1: one chain of drafted tokens, as priced (SGLang's default drafts a tree of up to 10 branches;
        # srt/arg_groups/fields/spec.py speculative_ngram_max_bfs_breadth)
        return (f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {setting.drafted + 1} "
                f"--speculative-ngram-max-bfs-breadth 1")
    serving = get_method(setting.method).servings([[setting.drafted, 1, setting.drafted + 1]])[0]
    args = serving.sglang_args
    return (f"--speculative-algorithm {args['speculative_algorithm']} --speculative-draft-model-path DRAFT "
            f"--speculative-num-steps {args['speculative_num_steps']} --speculative-eagle-topk "
            f"{args['speculative_eagle_topk']} --speculative-num-draft-tokens {args['speculative_num_draft_tokens']}")


def vllm_config(setting: Setting) -> dict:
    if setting.method == NGRAM:
        return {"method": NGRAM, "num_speculative_tokens": setting.drafted, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    serving = get_method(setting.method).servings([[setting.drafted, 1, setting.drafted + 1]])[0]
    return {"model": "DRAFT", **serving.vllm_speculative_config}


def vllm_schedule(best: dict[int, Prediction | None]) -> list[list[int]]:
    """[[start, end, K], ...] over batch sizes 1..: each predicted concurrency's best drafted tokens
    (0 where speculation does not pay) holds from it up to the next predicted one."""
    points = sorted(best)
    out: list[list[int]] = []
    for i, c in enumerate(points):
        start = 1 if i == 0 else c
        end = points[i + 1] - 1 if i + 1 < len(points) else c  # vLLM carries the last K on
        k = best[c].drafted if best[c] is not None else 0
        if out and out[-1][2] == k:
            out[-1][1] = end
        else:
            out.append([start, end, k])
    return out


def serving_commands(settings: list[Setting], best: dict[int, Prediction | None]) -> dict:
    """What the output prints and the JSON keeps: per best setting its SGLang flags and vLLM config,
    and vLLM's per-batch-size schedule over them (speculation off where none pays)."""
    chosen = [s for s in settings if any(p is not None and p.setting == s.label for p in best.values())]
    out = {"settings": [{"setting": s.label, "concurrency": [c for c, p in best.items() if p and p.setting == s.label],
                         "sglang": sglang_flags(s), "vllm_speculative_config": vllm_config(s)} for s in chosen]}
    # a chain drafter's K can change per step; a DFlash head is trained and exported for one block
    # size (vLLM is started with num_speculative_tokens = block - 1), so no schedule is emitted for it
    if chosen and all(s.extend or s.method == NGRAM for s in chosen):
        deepest = max(chosen, key=lambda s: s.drafted)
        out["vllm_schedule"] = {"version": f">= {VLLM_SCHEDULE_VERSION}",
                                "speculative_config": {**vllm_config(deepest),
                                                       "num_speculative_tokens_per_batch_size": vllm_schedule(best)}}
    return out
