"""Everything a run decides before any process starts, from its `JobConfig` (`prepare`): the target
folder and facts, the memory plan, the capture points, the dataset, the draft config; and a fresh
draft of it. Training, evaluation and the TP-node CLI build from here and from setup/target.py (the
target spec and stream), so they agree by construction; bad config fails here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import JobConfig
from ..data.chat_formats import chat_format
from ..data.dataset import TokenizedData, build_dataset
from ..draft.method import DraftMethod
from ..draft.registry import METHODS, method_of_spec
from ..draft.vocab import build_vocab_maps, count_tokens
from ..plan import check_fits, facts_from_folder, resolve_draft, with_hw_overrides
from ..plan.pipeline import check_pipeline_fits
from ..target_engine.base import TargetInfo
from ..target_engine.hf_config import load_embedding_and_head, read_target_info
from ..target_engine.layers import DEEPSEEK_RULE, layer_id_rule, sglang_layer_ids
from ..target_engine.models import resolve_target_path
from ..target_engine.sampling import Regeneration
from .data_checks import check_reserved_tokens, unused_special_ids
from .layout import World, check_layout
from .target import capture_points, end_of_turn_id, regeneration


@dataclass
class RunSetup:
    model_path: str
    info: TargetInfo
    capture_points: list[int]
    sglang_capture_ids: list[int]  # SGLang's ids for the capture points (docs/EAGLE3.md §4)
    tokenizer: object
    data: TokenizedData
    method: DraftMethod  # the method whose config job.draft is (draft/registry.py)
    draft_cfg: object  # the method's model config
    regeneration: Regeneration | None = None  # data.regenerate: how the target answers each prompt
    end_of_turn_id: int | None = None  # the token a served answer ends with (target.end_of_turn_token)


def prepare(job: JobConfig) -> RunSetup:
    """Everything decided before any process starts; bad config fails here."""
    from ..data.kimi_tiktoken import load_tokenizer

    check_layout(job.hw, World.from_env())  # torchrun ranks per node == target replicas of the hw profile
    model_path = resolve_target_path(job.target)
    info = read_target_info(model_path)
    facts = facts_from_folder(model_path, job.target.name)
    if job.hw.target_pp > 1:  # the pipeline's per-stage plan
        check_pipeline_fits(job, with_hw_overrides(job.hw, facts))
    else:
        check_fits(job, facts)  # memory plan and length limits: refuses with the override that would fit
    if layer_id_rule(info.architecture) == DEEPSEEK_RULE and job.hw.device == "cpu":  # DeepSeek-V2/V3, Kimi-K2.5
        from transformers import AutoConfig

        from ..target_engine.sglang_cpu_compat import check_deepseek_config

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=job.target.trust_remote_code)
        check_deepseek_config(getattr(config, "text_config", None) or config)
    method = method_of_spec(job.draft)
    points = capture_points(job, info, facts)
    eagle_ids = sglang_layer_ids(points, layer_id_rule(info.architecture))
    # Kimi-K2.5's remote-code tokenizer can fail on the pinned transformers; load_tokenizer then
    # builds the same tokenizer from the folder's files (data/kimi_tiktoken.py)
    tokenizer = load_tokenizer(model_path, trust_remote_code=job.target.trust_remote_code)
    eot_id = end_of_turn_id(tokenizer, job.target.end_of_turn_token)
    data = build_dataset(
        tokenizer, source=job.data.source, path=job.data.path, max_length=job.data.max_length,
        num_samples=job.data.num_samples, heldout_samples=job.data.heldout_samples,
        end_of_turn_id=eot_id, seed=job.data.seed,
        split=job.data.split, show_progress=job.train.progress, render=_renderer(job.target, tokenizer),
        fit_long_rows=job.data.fit_long_rows,
    )
    top = max((int(s.input_ids.max()) for s in [*data.train, *data.heldout] if len(s.input_ids)), default=-1)
    if top >= info.vocab_size:  # the engine would index past its embedding
        raise ValueError(f"the tokenizer produced token id {top}, outside the target's vocab ({info.vocab_size}): "
                         f"tokenizer and target weights in {model_path} do not match")
    unused = [t for t in unused_special_ids(tokenizer, data, eot_id) if t < info.vocab_size]
    draft_cfg = resolve_draft(method.with_unused_special_tokens(job.draft, unused), facts, len(points))
    check_reserved_tokens(method, draft_cfg, data, tokenizer, job.data.regenerate)
    check_context_parallel_method(job, method, draft_cfg)
    return RunSetup(model_path, info, points, eagle_ids, tokenizer, data, method, draft_cfg,
                    regeneration(job, tokenizer), eot_id)


def check_context_parallel_method(job: JobConfig, method: DraftMethod, draft_cfg) -> None:
    """hw.context_parallel > 1 needs a method whose loss takes a window of the positions and
    attention heads that split over the group (the layout is checked in setup/layout.py)."""
    cp = job.hw.context_parallel
    if cp == 1:
        return
    if not method.context_parallel:
        able = ", ".join(m.name for m in METHODS.values() if m.context_parallel)
        raise ValueError(f"hw.context_parallel={cp}: draft={method.name} does not split a sequence over ranks "
                         f"({able} do); use hw.context_parallel=1")
    heads = draft_cfg.num_attention_heads
    if heads % cp:
        raise ValueError(f"hw.context_parallel={cp}: the draft's {heads} attention heads do not split over {cp} ranks "
                         f"(draft.num_attention_heads must be a multiple of hw.context_parallel)")
    if job.data.regenerate:
        raise ValueError(f"hw.context_parallel={cp} with data.regenerate=true: not built yet (the answers would be "
                         f"counted once per rank of a group); use one of the two")


def _renderer(target, tokenizer):
    """The training renderer of the `target` group's chat format (None: the tokenizer's chat template)."""
    return chat_format(target.chat_format).renderer(tokenizer, target)


def prompt_renderer(target, tokenizer):
    """`messages -> ids` of the generation prompt after them, by the same renderer and format as
    the run's training data (`target`: its group; so eval measures the prompts the head was trained
    and is served on)."""
    return chat_format(target.chat_format).prompt_renderer(tokenizer, target)


def fresh_draft(setup: RunSetup, spec, seed: int, device: torch.device | str = "cpu",
                lm_head_dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    """An untrained draft of the run's method for `spec` (job.draft): seeded init, the target's
    embedding, vocab maps from the training split only, the target's lm_head attached where the
    method computes with it, trainable pieces started from the target's where the spec asks
    (`DraftMethod.init_from_target`); and the target's lm_head [V, Ht], on `device` in
    `lm_head_dtype` (default: as stored)."""
    torch.manual_seed(seed)
    d2t, t2d = build_vocab_maps(count_tokens(setup.data.train, setup.info.vocab_size), setup.draft_cfg.draft_vocab_size)
    embed, lm_head = load_embedding_and_head(setup.model_path)
    lm_head = lm_head.to(device, lm_head_dtype)
    draft = setup.method.build(setup.draft_cfg, embed=embed, lm_head=lm_head)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    setup.method.init_from_target(draft, spec, lm_head)
    return draft, lm_head


