"""Per-GPU memory plan of a run, checked before any process starts.

`python -m specforge_k25.plan +hw=rtxpro6000x8 target=kimi_k25 draft=kimi` prints it;
`check_fits(job)` (plan/fit.py) returns the `MemoryPlan` or raises `PlanError` naming an override that fits.

Everything here is plain arithmetic on plain numbers: the target's facts (plan/facts.py), the
trainer's items (plan/memory.py) and SGLang 0.5.23's sizing rules: the MLA KV cache holds
(kv_lora_rank + qk_rope_head_dim) values per token per layer on EVERY TP rank (the latent is not
sharded); the KV pool is min(profiled, hw.max_total_tokens) tokens, profiled = pre * f - weights -
mm_reservation where `pre` is the smallest free memory over the TP ranks before the weights load
and f is `mem_fraction_static`; startup fails when `pre` on one rank is below 0.9x another rank's
free memory (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK: our engine turns it off for CUDA TP > 1, the
trainer and the ring share rank 0's GPU by design).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..draft.method import DraftMethod
from .facts import GiB, MiB, PlanError, TargetFacts, draft_of, trainable_params
from ..target_engine.pages import whole_pages
from .engine import (engine_notes, extend_activation_bytes, extend_tokens, kv_page_size, nccl_note,
                     trainer_nccl_bytes)
from .kernels import MARLIN, int4_moe_backend, kernel_notes, marlin_scratch_bytes
from .memory import (Item, activation_note, embedding_host_bytes, gib, host_optimizer_note, offload_note, optimizer_items,
                     trainer_items)

ROLE_TARGET = "target TP rank"


@dataclass
class GpuBudget:
    gpu: int
    role: str
    capacity: int
    items: list[Item] = field(default_factory=list)

    def resident(self) -> int:
        return sum(i.bytes for i in self.items if i.phase is None)

    def phases(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.items:
            if i.phase is not None:
                out[i.phase] = out.get(i.phase, 0) + i.bytes
        return out

    def peak_phase(self) -> Optional[str]:
        phases = self.phases()
        return max(phases, key=phases.get) if phases else None

    def total(self) -> int:
        return self.resident() + max(self.phases().values(), default=0)

    def headroom(self) -> int:
        return self.capacity - self.total()

    def get(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)


@dataclass
class MemoryPlan:
    facts: TargetFacts
    draft: Any  # the method's config (resolve_draft)
    gpus: list[GpuBudget]
    kv_pool_tokens: int
    tokens_per_step: int
    mem_fraction_static: Optional[float]  # derived for SGLang (rounded up to 0.01); None on cpu
    mem_fraction_min: Optional[float]  # the smallest value SGLang accepts for this plan
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    capacity_ok: bool = True  # every GPU's peak fits and the target loads (what an override of sizes can fix)
    free_before_load: Optional[int] = None  # SGLang's `pre`: the smallest free memory of a TP rank before loading
    method: Optional[DraftMethod] = None  # the method job.draft configures (draft/registry.py)
    kv_page_size: int = 1  # tokens per KV page of the target's attention backend (plan/engine.py)

    @property
    def fits(self) -> bool:
        return not self.problems

    def gpu(self, gpu_id: int) -> GpuBudget:
        return next(g for g in self.gpus if g.gpu == gpu_id)


LAYOUTS = ("dedicated", "colocated")


@dataclass(frozen=True)
class NodeLayout:
    """Where a node's target TP ranks and trainer ranks sit (hw.trainer_layout), worked out once from
    the hw profile by `node_layout`: the plan, the launch checks (setup/layout.py), the CLI's torchrun
    relaunch and the trainer ranks (train/distributed.py) all read this value.

    dedicated: one trainer rank per target replica, on hw.trainer_gpus (null: [hw.trainer_gpu]); a
    rank reads the replica whose first GPU it sits on, else replica number local_rank (b300x8:
    trainer_gpus [0, 4], TP 4 -> rank 0 reads GPUs 0-3, rank 1 GPUs 4-7).
    colocated: one trainer rank beside every TP rank, rank order = GPU order; rank r reads replica
    r // tp (its TP rank r % tp). A pipeline-parallel target (hw.target_pp) takes tp x pp GPUs per
    replica, stage s on the s-th tp of them, and co-located a trainer rank beside each.
    A target spanning nodes (hw.target_nnodes) holds tp = target_tp / target_nnodes ranks per node;
    this is node 0's layout (the trainer's node).
    """

    colocated: bool
    tp: int  # TP ranks of one replica on this node
    groups: tuple[tuple[int, ...], ...]  # each replica's TP GPUs on this node (replica r from target_gpu + r * tp)
    trainer_gpus: tuple[int, ...]  # each trainer rank's GPU, by local rank (dedicated: as the profile lists them)
    reads: tuple[Optional[int], ...]  # the replica each trainer rank reads (None: a rank beyond the replicas)
    pp: int = 1  # pipeline stages of one replica (hw.target_pp)

    @property
    def replicas(self) -> int:
        return len(self.groups)

    @property
    def per_replica(self) -> int:
        """Trainer ranks that read one replica: its TP ranks of every stage (colocated), one (dedicated)."""
        return self.tp * self.pp if self.colocated else 1

    @property
    def ranks_per_node(self) -> int:
        """Trainer ranks torchrun starts on a node. (Dedicated on CPU with hw.trainer_gpus null may
        have more ranks than `trainer_gpus`: a CPU rank has no GPU.)"""
        return self.replicas * self.per_replica

    def rank_gpus(self, local_rank: int) -> tuple[int, int]:
        """(trainer GPU, first GPU of the replica it reads) of a rank on its node."""
        return self.trainer_gpus[local_rank], self.groups[self.reads[local_rank]][0]


def node_layout(hw) -> NodeLayout:
    """The node's `NodeLayout` from the hw profile; PlanError for an unknown hw.trainer_layout. Sizes
    are not judged here: the plan lists what does not fit the node (`_layout_problems`) and
    setup/layout.py `check_layout` refuses a launch that does not match."""
    if hw.trainer_layout not in LAYOUTS:
        raise PlanError(f"hw.trainer_layout={hw.trainer_layout!r}: expected one of {', '.join(LAYOUTS)}")
    coloc = hw.trainer_layout == "colocated"
    tp, replicas, pp = hw.target_tp // hw.target_nnodes, hw.target_replicas, hw.target_pp
    firsts = [hw.target_gpu + r * tp * pp for r in range(replicas)]
    groups = tuple(tuple(first + i for i in range(tp * pp)) for first in firsts)
    if coloc:
        trainers = tuple(g for group in groups for g in group)
        reads = tuple(rank // (tp * pp) for rank in range(len(trainers)))
    else:
        trainers = tuple(hw.trainer_gpu_ids())
        reads = tuple(firsts.index(gpu) if gpu in firsts else (rank if rank < replicas else None)
                      for rank, gpu in enumerate(trainers))
    return NodeLayout(coloc, tp, groups, trainers, reads, pp)


def target_batch_tokens(hw, batch_size: int, max_length: int) -> int:
    """Tokens of one target batch (at most): a dedicated trainer rank's micro-batch, or under
    colocated one micro-batch for each trainer rank of the replica (whole sequences shared out),
    for each group of hw.context_parallel ranks with context parallelism (they share sequences)."""
    return batch_size * max_length * node_layout(hw).per_replica // context_parallel(hw)


def context_parallel(hw) -> int:
    """The ranks that split a sequence: hw.context_parallel, co-located only (the plan's dedicated
    variant of a co-located job has none)."""
    return max(1, hw.context_parallel) if node_layout(hw).colocated else 1


def with_layout(hw, layout: str):
    """hw with hw.trainer_layout=`layout` for comparing layouts; context parallelism only where it
    applies (co-located: a dedicated rank reads whole sequences)."""
    return replace(hw, trainer_layout=layout, context_parallel=hw.context_parallel if layout == "colocated" else 1)


def context_parallel_problems(hw, layout: NodeLayout) -> list[str]:
    """hw.context_parallel: groups of co-located trainer ranks of one replica, each splitting its
    sequences' positions (train/context_parallel.py)."""
    cp = hw.context_parallel
    if cp < 1:
        return [f"hw.context_parallel={cp}: need at least 1 (1 = whole sequences per rank)"]
    if cp == 1:
        return []
    if not layout.colocated:
        return [f"hw.context_parallel={cp} splits a sequence over co-located trainer ranks: set "
                f"hw.trainer_layout=colocated (a dedicated rank reads a replica of its own)"]
    if layout.pp > 1:
        return [f"hw.context_parallel={cp} with hw.target_pp={layout.pp}: not built for pipeline stages yet (their "
                f"ranks get whole sequences from the last stage); use hw.target_pp=1"]
    if layout.per_replica % cp:
        return [f"hw.context_parallel={cp} does not divide the {layout.per_replica} co-located trainer ranks of a "
                f"replica (hw.target_tp={hw.target_tp}): use a divisor of {layout.per_replica}"]
    return []


def trainer_seq_len(hw, max_length: int, depth: int) -> int:
    """Positions of a sequence one trainer rank computes on: all of them, or with hw.context_parallel
    = C its window of ceil(T / C) plus the `depth` after it that its teacher reads (an upper bound:
    the last window has none)."""
    cp = context_parallel(hw)
    return max_length if cp == 1 else -(-max_length // cp) + depth


def target_batch_slots(hw, batch_size: int, max_length: int, page_size: int = 1) -> int:
    """KV slots one target batch holds: its sequences (`target_batch_tokens`' count of them), each
    in whole pages of `page_size` tokens (target_engine/pages.py)."""
    sequences = batch_size * node_layout(hw).per_replica // context_parallel(hw)
    return sequences * whole_pages(max_length, page_size)


def kv_pool_tokens(hw, batch_size: int, max_length: int, page_size: int = 1) -> int:
    """The engine's KV pool cap, in whole pages (SGLang floors its pool to pages): hw.max_total_tokens,
    raised to one whole target batch when that is larger (the engine cannot run a batch its pool does
    not hold; the memory plan counts the pool)."""
    return whole_pages(max(hw.max_total_tokens, target_batch_slots(hw, batch_size, max_length, page_size)), page_size)


def optimizer_device(value: Optional[str], device: str, trainer_gpus: list[int]) -> str | int | None:
    """train.optimizer_device as the plan sees it: None (the trainer's own device), "cpu" or a GPU id."""
    if value in (None, "", "none") or device != "cuda":
        return None
    if value == "cpu":
        return "cpu"
    if not value.startswith("cuda:") or not value[5:].isdigit():
        raise PlanError(f"train.optimizer_device={value!r}: expected null, cpu or cuda:N")
    gpu = int(value[5:])
    return None if list(trainer_gpus) == [gpu] else gpu


def plan_memory(job, facts: TargetFacts, *, max_length: int | None = None, batch_size: int | None = None,
                intermediate_size: int | None = None) -> MemoryPlan:
    """The budget of every GPU (no exception for a plan that does not fit: see `problems`).
    The keyword arguments replace the job's value (used to search for an override that fits)."""
    hw, tr = job.hw, job.train
    L = max_length or job.data.max_length
    B = batch_size or tr.batch_size
    spec = job.draft if intermediate_size is None else replace(job.draft, intermediate_size=intermediate_size)
    method, cfg = draft_of(job, facts, spec)
    num_aux = method.num_aux(cfg)  # target states captured per token: the ring and the batch carry them
    bf16 = hw.autocast == "bf16"
    layout = node_layout(hw)
    groups, trainers = layout.groups, list(layout.trainer_gpus)
    ranks, coloc = len(trainers), layout.colocated
    tokens_per_step = B * L * tr.grad_accum * ranks // context_parallel(hw)
    batch_tokens = target_batch_tokens(hw, B, L)
    page = kv_page_size(hw, facts)
    kv_tokens = kv_pool_tokens(hw, B, L, page)
    ctx = int(hw.cuda_context_gib * GiB) if hw.device == "cuda" else 0
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4  # the target's dtype: ring, frozen tensors
    # colocated: AdamW lives with the shards, on the GPUs or (cpu) on the host with FSDP2's CPU offload
    opt_dev = optimizer_device(tr.optimizer_device, hw.device, trainers)
    depth = method.depth(spec, cfg)  # TTT steps, or a block's positions
    t_items = trainer_items(cfg, batch=B, seq_len=trainer_seq_len(hw, L, depth), ttt_length=depth, teacher_chunk=tr.teacher_chunk,
                            bf16=bf16, data_parallel=ranks > 1, context_bytes=ctx, frozen_bytes=elem,
                            checkpoint=tr.activation_checkpointing, optimizer_offloaded=opt_dev is not None,
                            shards=ranks if coloc else 1, method=method)
    nccl, nccl_how = trainer_nccl_bytes(hw, ranks, context_parallel(hw))
    if nccl:
        t_items.append(Item("NCCL buffers (trainer communicators)", nccl, note=nccl_how))
    P = trainable_params(cfg, method)
    notes = [(offload_note(P, ranks, method.keep_units_gathered) if coloc else host_optimizer_note(P, ranks))
             ] if opt_dev == "cpu" else []
    notes.append(f"frozen embedding [V, H] in host memory: {gib(embedding_host_bytes(cfg, elem))} per trainer process, "
                 f"its rows looked up there and copied to the GPU (train/host_embedding.py)")
    if context_parallel(hw) > 1:
        notes.append(f"hw.context_parallel={hw.context_parallel}: each sequence split over {hw.context_parallel} "
                     f"co-located ranks, each computing on {trainer_seq_len(hw, L, depth)} of its {L} positions "
                     f"(window + teacher halo, what its ring carries; Ulysses attention over 1/{hw.context_parallel} of "
                     f"the heads)")
    if coloc:
        notes.append(f"hw.trainer_layout=colocated: {ranks} "
                     f"trainer ranks, one beside each TP rank, the draft state sharded 1/{ranks} each (FSDP2), "
                     + ("weights, grads and AdamW on the host (train.optimizer_device=cpu)" if opt_dev == "cpu"
                        else "AdamW on the GPUs"))
    if hw.device != "cuda":
        g = GpuBudget(-1, "trainer rank (host memory, not checked)", 0, t_items)
        return MemoryPlan(facts, cfg, [g], kv_tokens, tokens_per_step, None, None,
                          length_problems(facts, L), notes, method=method, kv_page_size=page)

    problems = _layout_problems(hw, facts, layout, opt_dev)
    target_items = _target_items(hw, facts, batch_tokens, kv_tokens, ctx, num_aux, page)
    carried = B * trainer_seq_len(hw, L, depth)  # context parallelism: each rank's window rows only
    ring = Item("stream ring slots (aux + final)", tr.stream_slots * carried * (num_aux + 1) * facts.hidden_size * elem,
                owner="stream", note=f"{tr.stream_slots} x {carried} tokens x {num_aux + 1}Ht x {elem} B")
    budgets, preloaded = _place_items(hw, ring, layout, target_items, t_items, opt_dev, P, ctx)
    capacity = hw.gpu_memory_mib * MiB
    frac = frac_min = free_before_load = None
    capacity_ok = capacity > 0 and facts.weight_bytes > 0
    if capacity > 0:
        # SGLang loads weights + KV pool + multimodal reservation out of f x (free memory before loading)
        static = sum(i.bytes for i in target_items if i.name in STATIC_ITEMS)
        margin = int(hw.kv_pool_margin_gib * GiB)
        frac_min, with_margin, free_before_load, balance_notes = _static_fraction(hw, groups, preloaded, static, margin,
                                                                                  capacity, ctx)
        notes += balance_notes
        frac = math.ceil(with_margin * 100) / 100 if math.isfinite(with_margin) else math.inf
        if frac_min >= 1:
            capacity_ok = False
            problems.append(f"the target does not load: weights + KV need {frac_min:.3f} of the free memory")
        elif frac >= 1:
            capacity_ok = False
            problems.append(f"the target loads only without a margin: weights + KV need {frac_min:.4f} of the free "
                            f"memory, {with_margin:.4f} with hw.kv_pool_margin_gib={hw.kv_pool_margin_gib}")
        elif hw.mem_fraction_static < with_margin:
            problems.append(f"hw.mem_fraction_static={hw.mem_fraction_static} is below what SGLang needs for the "
                            f"weights and a {kv_tokens}-token KV pool ({frac_min:.4f}) plus "
                            f"hw.kv_pool_margin_gib={hw.kv_pool_margin_gib} ({with_margin:.4f}): "
                            f"set hw.mem_fraction_static={frac}")
        for b in budgets:
            if b.total() > capacity:
                capacity_ok = False
                problems.append(f"GPU {b.gpu} ({b.role}) needs {gib(b.total())} of {gib(capacity)} "
                                f"(peak phase: {b.peak_phase() or '-'})")
    problems += length_problems(facts, L)
    notes.append(activation_note(cfg, B, trainer_seq_len(hw, L, depth), depth, bf16, tr.activation_checkpointing,
                                 method))
    notes += kernel_notes(hw, facts) + engine_notes(hw, facts, batch_tokens, page)
    if ranks > 1:
        notes.append(nccl_note(hw))
    if not coloc and (ranks > 1 or hw.target_replicas > 1):
        notes.append(f"data-parallel: launch with torchrun --nproc-per-node {hw.target_replicas} (one trainer rank "
                     f"per replica)")
    return MemoryPlan(facts, cfg, budgets, kv_tokens, tokens_per_step, frac, frac_min, problems, notes, capacity_ok,
                      free_before_load, method, kv_page_size=page)


def length_problems(facts: TargetFacts, max_length: int) -> list[str]:
    """The length limits of a run, on every device: a sample must fit the target's context (the KV
    pool grows to hold a batch: `kv_pool_tokens`)."""
    problems = []
    if max_length > facts.max_position_embeddings:
        problems.append(f"data.max_length={max_length} exceeds the target's context ({facts.max_position_embeddings}): "
                        f"lower data.max_length")
    return problems


def _layout_problems(hw, facts: TargetFacts, layout: NodeLayout, opt_dev) -> list[str]:
    """What no size override can fix: unknown sizes, GPUs that do not exist or overlap."""
    problems = list(context_parallel_problems(hw, layout))
    groups, trainers = layout.groups, list(layout.trainer_gpus)
    ranks = len(trainers)
    if layout.colocated and hw.target_nnodes > 1:
        problems.append("hw.trainer_layout=colocated is planned for one node only (hw.target_nnodes=1)")
    if hw.gpu_memory_mib <= 0:
        problems.append("hw.gpu_memory_mib is not set: the plan needs the GPU size (MiB, as nvidia-smi shows)")
    if facts.weight_bytes <= 0:
        problems.append("the target's weight size is unknown (no *.safetensors in target.path): set hw.target_weight_gb")
    used = sorted(g for group in groups for g in group)
    if len(set(used)) != len(used) or (used and (used[0] < 0 or used[-1] >= hw.num_gpus)):
        problems.append(f"target GPUs {used} do not fit on hw.num_gpus={hw.num_gpus} GPUs without overlap")
    for t in trainers:
        if not 0 <= t < hw.num_gpus:
            problems.append(f"trainer GPU {t} is not one of the {hw.num_gpus} GPUs")
    if isinstance(opt_dev, int) and not 0 <= opt_dev < hw.num_gpus:
        problems.append(f"train.optimizer_device=cuda:{opt_dev} is not one of the {hw.num_gpus} GPUs")
    if layout.colocated:  # hw.trainer_gpu(s) do not apply: every TP rank's GPU has a trainer rank
        if isinstance(opt_dev, int):
            problems.append(f"train.optimizer_device=cuda:{opt_dev} with hw.trainer_layout=colocated: each rank's "
                            f"AdamW stays with its shard, on its own GPU (null) or on the host (cpu)")
        return problems
    if len(set(trainers)) != ranks:
        problems.append(f"hw.trainer_gpus={trainers}: one trainer rank per GPU")
    if hw.trainer_gpus and trainers[0] != hw.trainer_gpu:
        problems.append(f"hw.trainer_gpu={hw.trainer_gpu} must equal hw.trainer_gpus[0]={trainers[0]} (rank 0)")
    if ranks != hw.target_replicas:
        problems.append(f"{ranks} trainer rank(s) but hw.target_replicas={hw.target_replicas}: each rank reads one replica's stream")
    return problems


ENGINE_ACTIVATIONS = "SGLang activations of one extend"
STATIC_ITEMS = ("target weights (TP shard + replicated)", "KV cache pool", "SGLang multimodal reservation")


def _target_items(hw, facts: TargetFacts, batch_tokens: int, kv_tokens: int, ctx: int, num_aux: int,
                  page: int = 1) -> list[Item]:
    """One SGLang TP rank's items on its GPU (num_aux: the captured states, besides the final one)."""
    items = [
        Item("CUDA context (SGLang TP rank)", ctx, owner="target"),
        Item("target weights (TP shard + replicated)", facts.weight_bytes_per_gpu(hw.target_tp), owner="target",
             note=f"({gib(facts.weight_bytes)} - {gib(facts.replicated_weight_bytes())}) / {hw.target_tp} + replicated"),
        Item("KV cache pool", kv_tokens * facts.kv_bytes_per_token(hw.target_tp), owner="target",
             note=f"{kv_tokens} tokens" + (f" = {kv_tokens // page} pages of {page}" if page > 1 else "")
                  + f" x {facts.kv_bytes_per_token(hw.target_tp)} B"),
        Item("SGLang multimodal reservation", 100 * MiB if facts.multimodal else 0, owner="target"),  # SGLANG_VLM_CACHE_SIZE_MB
        Item("SGLang runtime (workspaces, captured states)",
             int(hw.target_runtime_gib * GiB) + batch_tokens * (num_aux + 1) * facts.hidden_size * 2, owner="target",
             note="hw.target_runtime_gib + the batch's captured states (aux + final, bf16)"),
    ]
    forward = extend_tokens(hw, batch_tokens)  # chunked prefill: one chunk
    items.append(Item(ENGINE_ACTIVATIONS, extend_activation_bytes(hw, facts, forward), owner="target",
                      note=f"{forward} tokens: residual stream + the larger of MLA attention and MoE (plan/engine.py)"))
    if int4_moe_backend(hw, facts) == MARLIN:  # grows with one forward's tokens, unlike hw.target_runtime_gib
        scratch = marlin_scratch_bytes(facts, forward, hw.target_tp)
        items.append(Item("SGLang Marlin MoE scratch (INT4 experts)", scratch, owner="target",
                          note=f"{forward} tokens x top-{facts.num_experts_per_tok} x (max(2N, H) + N) x 2 B, "
                               f"N = expert width / TP (fused_marlin_moe; plan/kernels.py)"
                               + (" (one prefill chunk)" if forward < batch_tokens else "")))
    return items


def _place_items(hw, ring: Item, layout: NodeLayout, target: list[Item], t_items: list[Item], opt_dev,
                 P: int, ctx: int) -> tuple[list[GpuBudget], dict[int, int]]:
    """Every GPU's items (target TP ranks, stream rings, trainer ranks, AdamW elsewhere), sorted by
    GPU, and the bytes other processes hold on each GPU when SGLang measures its free memory."""
    budgets: dict[int, GpuBudget] = {}
    roles: dict[int, list[str]] = {}
    preloaded: dict[int, int] = {}

    def add(gpu: int, role: str, items: list[Item], before_engine: int = 0) -> None:
        budgets.setdefault(gpu, GpuBudget(gpu, "", hw.gpu_memory_mib * MiB)).items.extend(items)
        roles.setdefault(gpu, []).append(role)
        preloaded[gpu] = preloaded.get(gpu, 0) + before_engine

    coloc = layout.colocated
    for group in layout.groups:
        for gpu in group:
            add(gpu, ROLE_TARGET, list(target))
            if coloc:  # every TP rank fills its own trainer rank's ring on the same GPU
                add(gpu, "stream ring", [ring], ring.bytes)
        if not coloc:  # TargetStream puts the slots on cuda:{target_gpu}, allocated by the trainer process
            add(group[0], "stream ring", [ring], ring.bytes)
    for rank, gpu in enumerate(layout.trainer_gpus):
        replica = None if coloc else layout.reads[rank]
        if replica is not None and gpu != layout.groups[replica][0]:  # the trainer process also opens a context
            ring_ctx = Item("CUDA context (trainer process, for the ring)", ctx, owner="stream")  # on its ring's GPU
            add(layout.groups[replica][0], "stream ring", [ring_ctx], ctx)
    for gpu in layout.trainer_gpus:
        # allocated by build_learner before the target process starts
        add(gpu, "trainer rank", list(t_items), sum(i.bytes for i in t_items if i.phase is None
                                                    and not i.name.startswith(("draft grads", "AdamW"))))
        if isinstance(opt_dev, int):  # OffloadedAdamW on another GPU: the trainer process opens a context there too
            o_items = [Item("CUDA context (trainer process, for AdamW)", ctx)] + optimizer_items(P, on_gpu=True)
            add(opt_dev, "AdamW state", o_items, sum(i.bytes for i in o_items if i.phase is None and "m, v" not in i.name))
    for gpu, b in budgets.items():
        b.role = " + ".join(dict.fromkeys(roles[gpu]))
    return sorted(budgets.values(), key=lambda b: b.gpu), preloaded


def _static_fraction(hw, groups, preloaded: dict[int, int], static_bytes: int, margin_bytes: int, capacity: int,
                     ctx: int) -> tuple[float, float, int, list[str]]:
    """SGLang's smallest mem_fraction_static for this layout, the fraction that also keeps
    `margin_bytes` spare, the smallest `pre` (below) and notes on its TP balance check.

    SGLang 0.5.23 (KVCacheConfigurator._profile_available_bytes) sizes the KV pool from
    rest = free_after_load - pre x (1 - f) - multimodal reservation, where pre is the smallest free
    memory over a replica's TP ranks before loading (its own context counted) and free_after_load =
    pre - weights; the engine fails at start when rest <= 0 and the pool holds rest / bytes-per-token
    tokens (capped by max_total_tokens). So pre x f must hold weights + KV pool + reservation; the
    margin absorbs an estimate that is a little low (tests/plan/test_sglang_pool_sizing.py runs that
    SGLang function on the plan's numbers)."""
    frac_min = with_margin = 0.0
    fullest = None
    notes = []
    for group in groups:
        free = [capacity - ctx - preloaded.get(g, 0) for g in group]
        pre = min(free)
        fullest = pre if fullest is None else min(fullest, pre)
        frac_min = max(frac_min, static_bytes / pre if pre > 0 else math.inf)
        with_margin = max(with_margin, (static_bytes + margin_bytes) / pre if pre > 0 else math.inf)
        if hw.target_tp > 1 and pre < 0.9 * max(free):
            worst = group[free.index(pre)]
            notes.append(
                f"GPU {worst} has {gib(capacity - ctx - pre)} taken by the trainer/ring before the engine loads, "
                f"more than SGLang's 10% TP memory-balance check allows; the target runs with "
                f"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (set by target_engine/sglang_engine.py for every CUDA TP>1 "
                f"target) and this plan sizes the KV pool from the fullest rank")
    return frac_min, with_margin, fullest, notes
