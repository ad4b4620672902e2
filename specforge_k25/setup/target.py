"""The target side of a run, from its config: the capture points, the end-of-turn token, the
regeneration settings, the engine's TargetSpec and the target stream (not yet started). The
trainer's node and the nodes that only run TP ranks (train/tp_node.py) build them alike."""
from __future__ import annotations

import torch

from ..config import JobConfig
from ..plan import facts_from_folder, resolve_draft
from ..plan.budget import kv_pool_tokens
from ..plan.engine import prefill_chunk, run_page_size
from ..plan.facts import run_capture_points
from ..data.regenerate import regeneration_prompt
from ..stream.ring import SeqWindow
from ..stream.target_stream import TargetStream
from ..target_engine.base import TargetInfo
from ..target_engine.factory import TargetSpec, check_tp_layout
from ..target_engine.hf_config import read_target_info
from ..target_engine.models import resolve_target_path
from ..target_engine.sampling import Regeneration


def capture_points(job: JobConfig, info: TargetInfo, facts=None) -> list[int]:
    """The run's capture points (target.aux_layers, else the draft method's default, checked against
    the target), refused unless the draft method reads one aux state per point: K = len(points)
    sizes the engine's capture, the ring's slots and the trainer's batches. `facts`: the target's
    (plan/facts.py), read from its folder when not given."""
    points = run_capture_points(job, info.num_layers)  # target.aux_layers, else the method's default
    if facts is None:
        facts = facts_from_folder(resolve_target_path(job.target), job.target.name)
    resolve_draft(job.draft, facts, len(points))  # the method refuses a K it cannot read
    return points


def end_of_turn_id(tokenizer, token: str | None) -> int:
    """The id a served answer ends with: target.end_of_turn_token's, else the tokenizer's eos."""
    found = tokenizer.convert_tokens_to_ids(token) if token else tokenizer.eos_token_id
    if found is None or found == tokenizer.unk_token_id:
        raise ValueError(f"target.end_of_turn_token={token!r} is not a token of this tokenizer")
    return found


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
    stops = {end_of_turn_id(tokenizer, job.target.end_of_turn_token)}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return Regeneration(max_new_tokens=limit, max_length=d.max_length,
                        temperature=d.regen_temperature, top_p=d.regen_top_p, seed=d.regen_seed,
                        stop_ids=tuple(sorted(stops)), group_sequences=max(1, d.regen_group))


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


def context_window(job: JobConfig, setup, ranks) -> SeqWindow | None:
    """What this co-located rank's TP rank writes of each sequence under context parallelism: its
    window and the teacher's halo of the method's depth (train/learner.py reads the same);
    `setup`: the run's RunSetup."""
    if job.hw.context_parallel == 1:
        return None
    return SeqWindow(ranks.cp_rank, ranks.cp, setup.method.depth(job.draft, setup.draft_cfg))


def make_target_stream(job: JobConfig, setup, samples, batches: list[list[int]],
                       engine: str = "sglang", keep: list[list[int]] | None = None, ranks=None,
                       before: list[list[int]] = (), routes: list[list[list[int]]] | None = None,
                       known: dict | None = None) -> TargetStream:
    """The target process over `batches` (lists of indices into `samples`), not yet started;
    `setup`: the run's RunSetup (setup/run.py `prepare`). Regenerating, the target gets each sample's prompt (data/regenerate.py) and answers it; a
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
