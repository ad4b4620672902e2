"""Everything a run decides before any process starts, from its `JobConfig`: the target folder and
facts, the memory plan, the capture points, the dataset, the draft config, the target spec and the
stream. Training, evaluation and the TP-node CLI build from here, so they agree by construction;
bad config fails here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import JobConfig
from ..data.chat_formats import chat_format
from ..data.dataset import TokenizedData, build_dataset
from ..data.regenerate import regeneration_prompt
from ..draft.method import DraftMethod
from ..draft.registry import METHODS, method_of_spec
from ..draft.vocab import build_vocab_maps, count_tokens
from ..plan import check_fits, facts_from_folder, resolve_draft, with_hw_overrides
from ..plan.facts import run_capture_points
from ..plan.pipeline import check_pipeline_fits
from ..plan.budget import kv_pool_tokens
from ..plan.engine import prefill_chunk, run_page_size
from ..stream.ring import SeqWindow
from ..stream.target_stream import TargetStream
from ..target_engine.base import TargetInfo
from ..target_engine.factory import TargetSpec, check_tp_layout
from ..target_engine.hf_config import load_embedding_and_head, read_target_info
from ..target_engine.layers import DEEPSEEK_RULE, layer_id_rule, sglang_layer_ids
from ..target_engine.models import resolve_target_path
from ..target_engine.sampling import Regeneration
from .layout import World, check_layout


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
        check_pipeline_fits(job, with_hw_overrides(job, facts))
    else:
        check_fits(job, facts)  # memory plan and length limits: refuses with the override that would fit
    if layer_id_rule(info.architecture) == DEEPSEEK_RULE and job.hw.device == "cpu":  # DeepSeek-V2/V3, Kimi-K2.5
        from transformers import AutoConfig

        from ..target_engine.sglang_cpu_compat import check_deepseek_config

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=job.target.trust_remote_code)
        check_deepseek_config(getattr(config, "text_config", None) or config)
    method = method_of_spec(job.draft)
    points = capture_points(job, info)
    eagle_ids = sglang_layer_ids(points, layer_id_rule(info.architecture))
    # Kimi-K2.5's remote-code tokenizer can fail on the pinned transformers; load_tokenizer then
    # builds the same tokenizer from the folder's files (data/kimi_tiktoken.py)
    tokenizer = load_tokenizer(model_path, trust_remote_code=job.target.trust_remote_code)
    end_of_turn_id = _end_of_turn_id(tokenizer, job.target.end_of_turn_token)
    data = build_dataset(
        tokenizer, source=job.data.source, path=job.data.path, max_length=job.data.max_length,
        num_samples=job.data.num_samples, heldout_samples=job.data.heldout_samples,
        end_of_turn_id=end_of_turn_id, seed=job.data.seed,
        split=job.data.split, show_progress=job.train.progress, render=_renderer(job, tokenizer),
        fit_long_rows=job.data.fit_long_rows,
    )
    top = max((int(s.input_ids.max()) for s in [*data.train, *data.heldout] if len(s.input_ids)), default=-1)
    if top >= info.vocab_size:  # the engine would index past its embedding
        raise ValueError(f"the tokenizer produced token id {top}, outside the target's vocab ({info.vocab_size}): "
                         f"tokenizer and target weights in {model_path} do not match")
    unused = [t for t in unused_special_ids(tokenizer, data, end_of_turn_id) if t < info.vocab_size]
    draft_cfg = resolve_draft(method.with_unused_special_tokens(job.draft, unused), facts, len(points))
    check_reserved_tokens(method, draft_cfg, data, tokenizer, job.data.regenerate)
    check_context_parallel_method(job, method, draft_cfg)
    return RunSetup(model_path, info, points, eagle_ids, tokenizer, data, method, draft_cfg,
                    regeneration(job, tokenizer), end_of_turn_id)


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


def _special_ids(tokenizer) -> set[int]:
    return {int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False)}


def unused_special_ids(tokenizer, data: TokenizedData, end_of_turn_id: int | None = None) -> list[int]:
    """The tokenizer's special-token ids (ascending) that no sample holds, other than its bos, eos,
    pad and end-of-turn tokens: ids a draft method may reserve (`with_unused_special_tokens`)."""
    used = {int(t) for s in [*data.train, *data.heldout] for t in s.input_ids.unique().tolist()}
    return sorted(_special_ids(tokenizer) - used - {tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                    tokenizer.pad_token_id, end_of_turn_id})


def regeneration_note(job: JobConfig, setup: RunSetup) -> str | None:
    """For a training run: a method that learns the sequences' own tokens, trained on the dataset's answers."""
    if setup.method.needs_teacher or job.data.regenerate:
        return None
    return (f"note: draft={setup.method.name} learns the sequences' own next tokens (no teacher logits) and "
            f"data.regenerate=false: it learns the dataset's answers, not the target's; data.regenerate=true "
            f"trains it on the target's own answers (the method's recipe)")


def check_reserved_tokens(method: DraftMethod, draft_cfg, data: TokenizedData, tokenizer, regenerate: bool) -> None:
    """Refuse data that holds a token id the draft method reserves (DFlash: its mask token, which
    real input must never contain); note an id the tokenizer writes as ordinary text (a target's
    answer, data.regenerate, could still produce it)."""
    reserved = sorted(set(method.reserved_token_ids(draft_cfg)))
    if not reserved:
        return
    held = torch.tensor(reserved)
    found = {}
    for split, samples in (("train", data.train), ("held-out", data.heldout)):
        for i, s in enumerate(samples):
            hits = torch.isin(held, s.input_ids)
            for tok in held[hits].tolist():
                found.setdefault(tok, f"{split} sample {i}")
    specials = _special_ids(tokenizer)
    if found:
        free = unused_special_ids(tokenizer, data)[-3:]
        hint = (f"choose an id the data does not hold, e.g. a special token it never uses: draft.mask_token_id="
                f"{free[-1]} ({', '.join(repr(tokenizer.convert_ids_to_tokens(t)) for t in free)})" if free else
                "choose an id the data does not hold (draft.mask_token_id)")
        raise ValueError(f"draft={method.name} reserves token id(s) {reserved} (never in real input), but the "
                         f"data holds " + ", ".join(f"{t} ({tokenizer.convert_ids_to_tokens(t)!r}, first in the {where})"
                                                      for t, where in sorted(found.items())) + f": {hint}")
    ordinary = [t for t in reserved if t not in specials]
    if ordinary and specials and regenerate:
        print(f"note: draft={method.name} reserves token id(s) {ordinary} "
              f"({', '.join(repr(tokenizer.convert_ids_to_tokens(t)) for t in ordinary)}), ordinary text to this "
              f"tokenizer: none is in the dataset, but a regenerated answer could hold one (draft.mask_token_id "
              f"picks another)", flush=True)


def capture_points(job: JobConfig, info: TargetInfo) -> list[int]:
    """The run's capture points (target.aux_layers, else the draft method's default, checked against
    the target), refused unless the draft method reads one aux state per point: K = len(points)
    sizes the engine's capture, the ring's slots and the trainer's batches."""
    points = run_capture_points(job, info.num_layers)  # target.aux_layers, else the method's default
    facts = facts_from_folder(resolve_target_path(job.target), job.target.name)
    resolve_draft(job.draft, facts, len(points))  # the method refuses a K it cannot read
    return points


def _end_of_turn_id(tokenizer, token: str | None) -> int:
    end_of_turn_id = tokenizer.convert_tokens_to_ids(token) if token else tokenizer.eos_token_id
    if end_of_turn_id is None or end_of_turn_id == tokenizer.unk_token_id:
        raise ValueError(f"target.end_of_turn_token={token!r} is not a token of this tokenizer")
    return end_of_turn_id


def regeneration(job: JobConfig, tokenizer) -> Regeneration | None:
    """data.regen_* as the target processes use them; the answer stops at the end-of-turn token
    or the tokenizer's eos."""
    d = job.data
    if d.regen_source and not d.regenerate:
        raise ValueError(f"data.regen_source={d.regen_source} needs data.regenerate=true: the saved answers are the "
                         f"target's answers to the prompts this run regenerates")
    if not d.regenerate:
        return None
    if d.regen_cut not in ("keep", "drop"):
        raise ValueError(f"data.regen_cut={d.regen_cut!r}: expected keep or drop")
    limit = d.max_length if d.regen_max_new_tokens is None else d.regen_max_new_tokens  # null: the room below max_length
    if limit < 1 or d.regen_temperature < 0 or not 0 < d.regen_top_p <= 1:
        raise ValueError("data.regen_max_new_tokens must be >= 1 (or null), data.regen_temperature >= 0 and "
                         "data.regen_top_p in (0, 1]")
    stops = {_end_of_turn_id(tokenizer, job.target.end_of_turn_token)}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return Regeneration(max_new_tokens=limit, max_length=d.max_length,
                        temperature=d.regen_temperature, top_p=d.regen_top_p, seed=d.regen_seed,
                        stop_ids=tuple(sorted(stops)), group_sequences=max(1, d.regen_group))


def _renderer(job: JobConfig, tokenizer):
    """The training renderer of the run's chat format (None: the tokenizer's chat template)."""
    return chat_format(job.target.chat_format).renderer(tokenizer, job.target)


def prompt_renderer(job: JobConfig, tokenizer):
    """`messages -> ids` of the generation prompt after them, by the same renderer and format as
    the run's training data (so eval measures the prompts the head was trained and is served on)."""
    return chat_format(job.target.chat_format).prompt_renderer(tokenizer, job.target)


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


def target_spec(job: JobConfig, engine: str = "sglang", tokenizer=None) -> TargetSpec:
    """The TargetSpec of a run. The trainer's node and the nodes that only run TP ranks
    (train/tp_node.py) build it from the same config, so every rank loads the same engine (and,
    regenerating, decodes with the same settings; `tokenizer`: the run's, else loaded)."""
    hw = job.hw
    if hw.target_nnodes > 1 and hw.target_replicas != 1:
        raise ValueError(f"hw.target_nnodes={hw.target_nnodes}: a target spanning nodes runs as one replica with "
                         f"one trainer rank (hw.target_replicas=1), not {hw.target_replicas}")
    if job.data.regenerate and hw.target_pp > 1:
        raise ValueError(f"data.regenerate=true with hw.target_pp={hw.target_pp}: a pipeline-parallel target does "
                         f"not decode yet; regenerate with hw.target_pp=1 or train on the dataset's answers")
    model_path = resolve_target_path(job.target)
    info = read_target_info(model_path)
    spec = TargetSpec(engine=engine, model_path=model_path, architecture=info.architecture,
                      capture_points=capture_points(job, info),
                      device=hw.device, dtype=hw.target_dtype, tp_size=hw.target_tp, pp_size=hw.target_pp, gpu_id=hw.target_gpu,
                      max_total_tokens=kv_pool_tokens(hw, job.train.batch_size, job.data.max_length, run_page_size(hw, model_path)), mem_fraction_static=hw.mem_fraction_static,
                      attention_backend=hw.target_attention_backend, num_threads=hw.target_threads, trust_remote_code=job.target.trust_remote_code,
                      nnodes=hw.target_nnodes, node_rank=hw.target_node_rank, dist_init_addr=hw.target_dist_init_addr,
                      dist_timeout=round(hw.target_dist_timeout_s if hw.target_dist_timeout_s is not None
                                         else job.train.dist_timeout_s),
                      load_threads=hw.target_load_threads, prefill_chunk=prefill_chunk(hw))
    if job.data.regenerate:
        if tokenizer is None:
            from ..data.kimi_tiktoken import load_tokenizer

            tokenizer = load_tokenizer(model_path, trust_remote_code=job.target.trust_remote_code)
        spec.regeneration = regeneration(job, tokenizer)
    check_tp_layout(spec)
    return spec


def context_window(job: JobConfig, setup: RunSetup, ranks) -> SeqWindow | None:
    """What this co-located rank's TP rank writes of each sequence under context parallelism: its
    window and the teacher's halo of the method's depth (train/step.py reads the same)."""
    if job.hw.context_parallel == 1:
        return None
    return SeqWindow(ranks.cp_rank, ranks.cp, setup.method.depth(job.draft, setup.draft_cfg))


def make_target_stream(job: JobConfig, setup: RunSetup, samples, batches: list[list[int]],
                       engine: str = "sglang", keep: list[list[int]] | None = None, ranks=None,
                       before: list[list[int]] = (), routes: list[list[list[int]]] | None = None,
                       known: dict | None = None) -> TargetStream:
    """The target process over `batches` (lists of indices into `samples`), not yet started.
    Regenerating, the target gets each sample's prompt (data/regenerate.py) and answers it; a
    resume passes the batches run `before`, so that it decodes in the same groups (TargetStream), and
    `known` holds the conversations saved already (never decoded again).

    Co-located (`ranks` with several trainer ranks per replica, train/distributed.py): only this
    rank's TP rank, its ring on this rank's GPU carrying the positions `keep` of each batch; the
    replica's TP rank 0 stream serves the rendezvous and its port reaches the others (a collective).
    Beside a pipeline's stages (hw.target_pp > 1), `routes` holds every rank's positions (TargetStream)."""
    sequences = ([regeneration_prompt(s) for s in samples] if setup.regeneration is not None
                 else [s.input_ids for s in samples])
    spec = target_spec(job, engine, setup.tokenizer)
    colocated = ranks is not None and ranks.per_replica > 1
    gpu = job.hw.trainer_gpu if colocated else job.hw.target_gpu  # colocated: the trainer's GPU is its TP rank's
    stream = TargetStream(spec, sequences, batches, hidden_size=setup.info.hidden_size, slots=job.train.stream_slots,
                          timeout_s=job.train.stream_timeout_s, start_timeout_s=job.train.engine_start_timeout_s,
                          dtype=getattr(torch, job.hw.target_dtype),
                          device="cpu" if job.hw.device == "cpu" else f"cuda:{gpu}",
                          tp_rank=ranks.replica_rank if colocated else None, keep=keep if colocated else None,
                          before=before, routes=routes if colocated and spec.pp_size > 1 else None,
                          window=context_window(job, setup, ranks) if colocated else None, known=known)
    if colocated:
        port = stream.open_rendezvous() if ranks.replica_rank == 0 else None
        ports = ranks.gather(port)  # every rank takes part
        if port is None:
            stream.join_rendezvous(ports[ranks.replica * ranks.per_replica])
    return stream
