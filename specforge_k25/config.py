"""Typed configuration of a training run. Hydra YAML in `conf/` fills these dataclasses.

Every field carries a one-line `help`; `python -m specforge_k25.train --help` prints them.
Library code receives these plain objects, never Hydra.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .draft.eagle3.config import Eagle3Spec
from .draft.registry import METHODS
from .fields import check_limits, doc, field_lines

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@dataclass
class HwConfig:
    name: str = doc("cpu", "hardware profile name")
    device: str = doc("cpu", "device of the target engine and the trainer: cpu | cuda")
    target_tp: int = doc(1, "tensor-parallel size of the SGLang target", at_least=1)
    target_pp: int = doc(1, "pipeline-parallel stages of the SGLang target (one node; target_pp x target_tp ranks, stage s on GPUs target_gpu+s*target_tp..); the last stage hands the states to a dedicated trainer rank; no regeneration; 1 = no pipeline", at_least=1)
    target_gpu: int = doc(0, "first GPU id of the target (TP ranks use target_gpu..target_gpu+tp-1)", at_least=0)
    target_nnodes: int = doc(1, "nodes the target's TP group spans (SGLang nnodes; target_tp/target_nnodes ranks each); node 0 also runs the trainer", at_least=1)
    target_node_rank: int = doc(0, "this node's index in the target's TP group (SGLang node_rank); 0 = the trainer's node", at_least=0)
    target_dist_init_addr: Optional[str] = doc(None, "HOST:PORT on node 0 where the target's TP ranks meet (SGLang dist_init_addr); needed when target_nnodes > 1")
    target_dist_timeout_s: Optional[float] = doc(None, "SGLang dist_timeout of the target's TP group: its setup and collectives fail after this long (a rank that never arrives or hangs); null = train.dist_timeout_s", above=0)
    target_load_threads: int = doc(8, "shards SGLang's multithreaded safetensors loader reads at a time per TP rank (its default 8; host memory while loading: up to threads + 2 shards per rank)", at_least=1)
    gpu_arch: Optional[str] = doc(None, "compute capability of the node's GPUs, e.g. sm90 (H100/H200), sm100 (B200), sm103 (B300), sm120 (RTX PRO 6000): which INT4 MoE kernels SGLang runs (memory plan, kernel checks); null = not known")
    trainer_gpu: int = doc(0, "GPU id of the dedicated trainer rank", at_least=0)
    target_dtype: str = doc("float32", "target compute dtype in SGLang: float32 | bfloat16")
    target_threads: int = doc(1, "CPU threads of the target process (cpu only)", at_least=1)
    trainer_threads: int = doc(1, "CPU threads of the trainer process (cpu only)", at_least=1)
    host_threads_per_rank: Optional[int] = doc(None, "CPU threads of a trainer rank with train.optimizer_device=cpu: its host AdamW, and on cuda all its host work (the clipping over the host grads too; torchrun leaves each rank OMP_NUM_THREADS=1); null = the node's cores / its local ranks on cuda, trainer_threads on cpu; the throughput plan's host AdamW time scales with it (docs/PERFORMANCE.md §3.1)", at_least=1)
    mem_fraction_static: float = doc(0.6, "SGLang static memory fraction (weights + KV pool); on CPU a share of system memory (other processes drawing on it during the weight load count against it), the pool capped by max_total_tokens", above=0)
    kv_pool_margin_gib: float = doc(1.0, "memory plan: GiB the derived mem_fraction_static keeps above SGLang's minimum (weights + KV pool + multimodal reservation), so a slightly low estimate does not fail the engine at start", at_least=0)
    target_attention_backend: Optional[str] = doc(None, "SGLang attention_backend of the target (e.g. fa3, triton, trtllm_mla, flashinfer); null = SGLang's choice per GPU (cpu: torch_native)")
    target_prefill_chunk: Optional[int] = doc(None, "tokens per target forward: a longer batch is prefilled in chunks, each extending the KV of the earlier ones and ending on a KV page boundary (as SGLang's chunked_prefill_size), bounding one forward's activations; null = on cuda SGLang's own chunked_prefill_size for hw.gpu_memory_mib (8192 below 160 GiB, 16384 above: plan/engine.py), on cpu the whole batch in one forward", at_least=1)
    max_total_tokens: int = doc(16384, "SGLang KV pool cap in tokens; raised to one whole target batch (train.batch_size x data.max_length, x target_tp when colocated) when smaller", at_least=1)
    autocast: str = doc("none", "trainer autocast dtype: none | bf16")
    gpu_memory_mib: int = doc(0, "memory per GPU in MiB as nvidia-smi reports it (memory plan); 0 = not planned", at_least=0)
    num_gpus: int = doc(1, "GPUs on the node (memory plan)", at_least=1)
    target_replicas: int = doc(1, "data-parallel target copies per node, one trainer rank each (torchrun --nproc-per-node); replica r on GPUs target_gpu+r*tp..", at_least=1)
    trainer_gpus: Optional[list] = doc(None, "GPU of each data-parallel trainer rank on a node (rank r reads the replica starting on its GPU); null = [trainer_gpu]")
    cuda_context_gib: float = doc(0.75, "memory plan: CUDA context per process per GPU (GiB)", at_least=0)
    target_runtime_gib: float = doc(2.0, "memory plan: SGLang non-static memory per TP rank besides the activations of one extend, which the plan counts from its tokens: workspaces, its own NCCL buffers (GiB)", at_least=0)
    trainer_nccl_channels: int = doc(16, "memory plan: NCCL channels of a trainer rank's communicators (NCCL picks them per topology; each channel holds NCCL_BUFFSIZE 4 MiB per ring neighbour and direction: plan/engine.py)", at_least=1)
    target_weight_gb: Optional[float] = doc(None, "memory plan: target weight size in GB (all ranks); null = its safetensors files / known default", above=0)
    trainer_layout: str = doc("dedicated", "dedicated = one trainer rank per replica, on trainer_gpus | colocated = one trainer rank beside every TP rank (torchrun --nproc-per-node replicas x target_tp), each reading its TP rank's copy of the hidden states, the draft state sharded over them (FSDP2)")
    context_parallel: int = doc(1, "co-located trainer ranks that split each sequence's positions (Ulysses attention: each holds 1/C of the positions' activations, attends with 1/C of the heads); divides the replica's trainer ranks; train.batch_size is then per group of C; DFlash's ranks each run the blocks anchored in their positions and gather the context's keys/values; 1 = whole sequences per rank", at_least=1)
    peak_tflops: float = doc(0.0, "throughput plan: dense bf16 tensor-core peak of one GPU in TFLOP/s (datasheet); 0 = no throughput plan", at_least=0)
    memory_gbps: float = doc(0.0, "throughput plan: memory bandwidth of one GPU in GB/s (datasheet): the target's weight reads, the GPU AdamW step", at_least=0)
    link_gbps: float = doc(0.0, "throughput plan: all-reduce bus bandwidth between the node's GPUs in GB/s (nccl-tests busbw; PCIe or NVLink): TP all-reduce, gradient traffic", at_least=0)
    internode_gbps: float = doc(0.0, "throughput plan: bandwidth between nodes per GPU in GB/s (its NIC share; e.g. 50 for 400 Gb/s InfiniBand): multi-node data parallel (HSDP) all-reduces its gradients across nodes over it; 0 = not planned", at_least=0)
    trainer_efficiency: float = doc(0.433, "throughput plan: share of peak_tflops the trainer's step reaches (teacher + TTT fwd/bwd; measured on an H200, docs/PERFORMANCE.md §3)", above=0)
    target_efficiency: float = doc(0.35, "throughput plan: share of peak_tflops SGLang's prefill matmuls and attention reach, all-reduce apart (assumed; docs/PERFORMANCE.md §5)", above=0)
    allreduce_latency_us: float = doc(0.0, "serving prediction (python -m specforge_k25.serving): fixed time of one TP all-reduce at decode sizes in microseconds, besides its bytes / link_gbps (docs/PERFORMANCE.md §9)", at_least=0)
    decode_memory_efficiency: float = doc(0.75, "serving prediction: share of memory_gbps a decode or verify step's weight and KV reads reach (assumed; docs/PERFORMANCE.md §9)", above=0)

    def trainer_gpu_ids(self) -> list[int]:
        """The GPU of each trainer rank on a node (rank r reads the replica starting there)."""
        return list(self.trainer_gpus) if self.trainer_gpus else [self.trainer_gpu]


@dataclass
class KimiOptions:
    """target.kimi.*: the Kimi-K2.5 renderer's options (target.chat_format=kimi; docs/KIMI_K25.md §5)."""
    default_system: Optional[str] = doc(None, "system turn put before a conversation that has none; null = none, as Kimi-K2.5's template (Kimi-K2-Instruct/K2-Thinking's insert \"You are Kimi, an AI assistant created by Moonshot AI.\")")
    declare_tools: bool = doc(True, "render a row's `tools` as the template's tool_declare turn (TypeScript style) before the conversation")
    tool_call_ids: str = doc("kimi", "kimi = a tool call id not of the form functions.NAME:IDX is renumbered (and its result's tool_call_id with it), a call without an id skips the row (tool_call_without_id) | verbatim = ids as the data gives them, a missing one printed None as the server does")
    tool_call_index: str = doc("global", "IDX of a renumbered call counts the calls of the conversation (global) or of its message (per_message)")
    tool_arguments: str = doc("served", "served = a call's JSON arguments printed as SGLang serves them in a prompt (parsed, then json.dumps), the final turn's as generated (the string as given) | verbatim = the string as given")
    keep_reasoning: str = doc("tool_loop", "thinking mode: reasoning kept in the assistant turns after the last one without tool calls (tool_loop, the template's) | the final turn's only (final)")
    supervise_history: bool = doc(True, "train on earlier assistant turns too (their reasoning dropped), not only the final turn(s)")
    missing_reasoning: str = doc("error", "thinking mode: a kept turn without reasoning_content is refused (error) or rendered <think></think> (empty)")
    add_bos: bool = doc(False, "prepend [BOS] (the template does not)")


@dataclass
class TargetConfig:
    name: str = doc("smollm2", "target name (for logs and checks)")
    builtin: str = doc("smollm2", "embedded target built locally when path is unset: smollm2 | tiny_deepseek | tiny_kimi | none")
    path: Optional[str] = doc(None, "HF-format model folder; overrides `builtin`")
    aux_layers: Optional[list] = doc(None, "capture points = inputs of these decoder layers (the EAGLE-3 draft takes 3); null = the draft method's default (the built-in methods' [2, L//2, L-3]; none for a method that reads only the final hidden state); [] = none")
    end_of_turn_token: Optional[str] = doc(None, "token closing an assistant turn; null = tokenizer eos")
    trust_remote_code: bool = doc(False, "pass trust_remote_code to tokenizer and engine (Kimi needs it)")
    chat_format: str = doc("template", "data/chat_formats.py: template (the tokenizer's chat template) | kimi (Kimi-K2.5 format, thinking/tools; options target.kimi.*)")
    chat_mode: str = doc("thinking", "kimi format: the serving mode to train for, thinking | instant")
    kimi: KimiOptions = field(default_factory=KimiOptions)
    tiny_layers: int = doc(8, "tiny_deepseek / tiny_kimi: number of decoder layers", at_least=1)
    tiny_hidden: int = doc(128, "tiny_deepseek / tiny_kimi: hidden size", at_least=1)


@dataclass
class DataConfig:
    source: str = doc("sharegpt", "sharegpt (packaged ShareGPT V3) | jsonl | hf")
    path: Optional[str] = doc(None, "file (jsonl), dataset name/folder or save_to_disk folder (hf); null = the packaged ShareGPT")
    split: str = doc("train", "split name for source=hf")
    max_length: int = doc(256, "tokens per sample; a longer conversation becomes what trains the most of it (see fit_long_rows)", at_least=1)
    fit_long_rows: bool = doc(True, "a conversation over max_length: the whole one cut at max_length, or a suffix of its whole turns (from a user turn, system kept, rendered as served) cut there, whichever trains more tokens; false: the cut only")
    num_samples: int = doc(200, "training conversations to use", at_least=1)
    heldout_samples: int = doc(20, "held-out conversations for evaluation (never trained on)", at_least=0)
    seed: int = doc(0, "shuffle seed of the train/held-out split")
    regenerate: bool = doc(False, "train on the target's own answers: each sample's final assistant turn is regenerated by the target engine (online, nothing on disk) and its hidden states prefilled")
    regen_max_new_tokens: Optional[int] = doc(128, "regeneration: most new tokens per answer (also bounded by max_length); null = up to max_length, for thinking-mode targets whose answers run to thousands of tokens", at_least=1)
    regen_temperature: float = doc(0.0, "regeneration: sampling temperature as served (0 = greedy, as the eval decodes)", at_least=0)
    regen_top_p: float = doc(1.0, "regeneration: nucleus sampling mass as served", above=0)
    regen_seed: int = doc(0, "regeneration: seed of the per-prompt random streams (a resume regenerates identically)")
    regen_group: int = doc(16, "regeneration: prompts the target decodes together, ahead of training (one decode step costs about the same for 1 or 16; KV memory bounded by one group; the answers are held in host memory until their last use, 4 bytes a token)", at_least=1)
    regen_cut: str = doc("keep", "regeneration: an answer cut at its budget is kept with its mask (keep) or masked out and counted (drop)")
    regen_source: Optional[str] = doc(None, "regeneration: answers saved by an earlier run (its folder, or its regenerated_ids.jsonl) to train on instead of decoding those prompts again (the rest are decoded); refused unless saved with this run's target and data.regen_* settings; null = decode every prompt (once per run: later epochs and a resume reuse the run's own saved answers)")


@dataclass
class TrainConfig:
    lr: float = doc(5e-5, "peak learning rate (AdamW)", above=0)
    betas: list = doc([0.9, 0.95], "AdamW betas")
    weight_decay: float = doc(0.0, "AdamW weight decay", at_least=0)
    warmup_ratio: float = doc(0.015, "fraction of optimizer steps of linear warmup, then the lr_schedule", at_least=0)
    lr_schedule: str = doc("cosine", "LR after warmup (train/optim.py): cosine (to 0 at the last step) | wsd (warmup-stable-decay: the peak LR, then linear to 0 over the last decay_ratio of the steps)")
    decay_ratio: float = doc(0.2, "lr_schedule=wsd: fraction of optimizer steps of the final linear decay to 0", at_least=0)
    grad_clip: float = doc(0.5, "max gradient norm", above=0)
    batch_size: int = doc(1, "sequences per micro-batch per trainer rank (global batch = batch_size x ranks)", at_least=1)
    group_by_length: bool = doc(True, "micro-batches of similar lengths (each window of 32 global batches sorted by length, its batches shuffled), so less of a batch is padding; the run plan prints the padding share")
    grad_accum: int = doc(1, "micro-batches per optimizer step", at_least=1)
    epochs: int = doc(1, "passes over the training samples", at_least=1)
    max_steps: Optional[int] = doc(None, "stop after this many optimizer steps (null = epochs)", at_least=1)
    teacher_chunk: int = doc(1024, "positions per teacher logits chunk ([chunk, V] at most)", at_least=1)
    activation_checkpointing: bool = doc(False, "recompute each TTT step in backward instead of keeping its activations (~1 more forward; the memory plan shows the saving)")
    optimizer_device: Optional[str] = doc(None, "where AdamW's fp32 master weights and m/v live: null = the trainer's device | cpu (host memory; co-located ranks: FSDP2's CPU offload of their weight, grad and AdamW shards) | cuda:N (another GPU; dedicated layout only)")
    stream_slots: int = doc(3, "shared-memory slots between target and trainer (backpressure bound)", at_least=1)
    routing_capture: bool = doc(True, "MoE targets: count the experts each window of consecutive prefilled tokens routes to (routing.pt / routing.json in the run folder, the summary, wandb) for `python -m specforge_k25.serving`; reads the routing, never changes it; dense targets record nothing")
    stream_timeout_s: float = doc(600.0, "fail if the target produces no batch for this long (after the first)", above=0)
    engine_start_timeout_s: float = doc(3600.0, "fail if the engine's first batch takes longer (load + warm-up)", above=0)
    dist_timeout_s: float = doc(1800.0, "trainer ranks (and the target TP group unless hw.target_dist_timeout_s is set): fail a collective that waits longer (a dead or hung rank); must exceed the spread of engine start times", above=0)
    heartbeat_timeout_s: Optional[float] = doc(None, "several trainer ranks: each publishes a heartbeat on the run's store (torchrun's) and watches the others' (train/heartbeat.py); a rank silent this long (died, killed, aborted by NCCL's watchdog) or one stuck past train.step_timeout_s ends every rank within seconds, naming it (the newest complete checkpoint is the progress). null: 60 on NCCL, off on gloo (its collectives raise by themselves); 0: off", at_least=0)
    step_timeout_s: float = doc(600.0, "with the heartbeat: the longest a rank may spend in one schedule item (forward, backward, optimizer step and their collectives) before the run ends, naming it; start-up, checkpoints and the export are bounded by train.dist_timeout_s instead, the wait for the target's batch by the larger of it and train.engine_start_timeout_s", above=0)
    log_every: int = doc(10, "optimizer steps between metric logs", at_least=1)
    eval_every: Optional[int] = doc(None, "optimizer steps between held-out evaluations (null: start and end only)", at_least=1)
    checkpoint_every: Optional[int] = doc(None, "optimizer steps between checkpoints (null or 0: end only)", at_least=0)
    keep_checkpoints: int = doc(2, "checkpoints kept on disk", at_least=1)
    resume: str = doc("none", "none | auto (newest complete checkpoint in out_dir) | a checkpoint folder")
    seed: int = doc(0, "seed of draft init and sample order")
    out_dir: Optional[str] = doc(None, "run folder (checkpoints, export); null = Hydra's output dir")
    logger: str = doc("wandb", "wandb | none")
    wandb_project: str = doc("specforge_k25", "wandb project")
    wandb_mode: str = doc("offline", "wandb mode: offline | online | disabled")
    progress: bool = doc(True, "show progress bars")


@dataclass
class JobConfig:
    hw: HwConfig = field(default_factory=HwConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # the draft method's own config (draft/<method>/config.py), chosen by the `draft` group:
    # draft=eagle3 | eagle3_mla | dflash, or a profile of one (conf/draft/*.yaml)
    draft: Any = field(default_factory=Eagle3Spec)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):  # OmegaConf.to_object builds it: composition refuses a bad size by name
        check_limits(self)


@dataclass
class EvalConfig:
    """`python -m specforge_k25.eval`: acceptance length measured by SGLang's own speculative decoding."""

    prompt_sets: list = doc(["mtbench", "humaneval", "heldout"], "prompt sets: mtbench | humaneval | heldout (the training data's held-out split)")
    num_prompts: int = doc(8, "prompts per set (the first n; MT-bench: first turns)", at_least=1)
    max_new_tokens: int = doc(64, "greedy tokens generated per prompt", at_least=1)
    chains: list = doc([[3, 1, 4], [7, 1, 8]], "speculative settings as [num_steps, eagle_topk, num_draft_tokens], one engine run each per head; topk must be 1 on CPU. Each head's method reads them (DraftMethod.servings): a chain drafter (EAGLE-3) at each, a block drafter (DFlash) at a block of each distinct num_draft_tokens (the last token + size-1 drafts)")
    methods: list = doc(["nospec", "ngram", "untrained", "trained"], "rows of the table: nospec | ngram | untrained (a fresh head of the run's draft method) | trained (export_dir, any method)")
    heads: dict = doc({}, "more exported heads (any draft method) evaluated beside export_dir on the same greedy outputs, one row each: +eval.heads.NAME=FOLDER")
    ngram_max: int = doc(3, "prompt-lookup baseline: longest n-gram matched", at_least=1)
    ngram_min: int = doc(1, "prompt-lookup baseline: shortest n-gram matched", at_least=1)
    max_running_requests: int = doc(8, "SGLang batch size (requests decoded together)", at_least=1)
    untrained_seed: int = doc(0, "seed of the untrained head's random init")
    draft_attention_backend: Optional[str] = doc(None, "SGLang speculative_draft_attention_backend (GPU; a GQA draft behind Kimi, whose MLA backend does not fit it: e.g. fa3); null = SGLang's choice")
    output: Optional[str] = doc(None, "folder for eval.json / eval.md, and Hydra's run folder (.hydra/, log); null = outputs/eval/<date>/<time>")


@dataclass
class EvalJobConfig(JobConfig):
    export_dir: Optional[str] = doc(None, "the trained head (a `train` run's export/ folder); null = untrained head and baselines only")
    eval: EvalConfig = field(default_factory=EvalConfig)


def describe(cls=JobConfig) -> list[str]:
    """One line per field: `group.name (default) - help`; `draft.*` once per draft method, under
    the `draft=<option>` that selects it (the default first)."""
    lines = field_lines(cls, skip=("draft",))
    for name, method in METHODS.items():
        lines.append(f"draft={name}: {method.summary}")
        lines += field_lines(method.spec_class, "draft.")
    return lines


def draft_profiles(conf_dir: str = CONF_DIR) -> list[str]:
    """The profiles of the `draft` group: conf/draft/*.yaml, each a method's config with some fields set."""
    return sorted(p.stem for p in Path(conf_dir, "draft").glob("*.yaml"))


def draft_options() -> str:
    """The `draft=` options: every registered method (draft/registry.py, a plug-in's included) and the profiles."""
    return (f"draft={' | '.join(METHODS)} (a method at its defaults, sizes from the target), "
            f"draft={' | '.join(draft_profiles())} (profiles of one, conf/draft/)")


def check_profile_names(conf_dir: str = CONF_DIR) -> None:
    """ValueError for a profile named after a method: Hydra would read `defaults: [<method>]` inside
    it as the file itself, and recurse until Python gives up (a bare RecursionError)."""
    clash = [name for name in draft_profiles(conf_dir) if name in METHODS]
    if clash:
        raise ValueError(f"{', '.join(f'conf/draft/{n}.yaml' for n in clash)}: a draft profile named after its method "
                         f"({', '.join(clash)}); a profile takes a name of its own (e.g. kimi_{clash[0]}) and starts "
                         f"with `defaults: [{clash[0]}, _self_]`")


class _DraftGroupMessage:
    """Where draft.method went, with the options listed when shown (methods registered later included)."""

    def __str__(self) -> str:
        return "the draft config group, which also selects the method's own draft.* fields: " + draft_options()


# Keys that left the config, with where their meaning went: an override of one fails before Hydra
# composes, naming the new home (Hydra alone would say only that the key is not in the struct).
MOVED_KEYS = {
    "draft.method": _DraftGroupMessage(),
    "train.ttt_length": "draft.ttt_length (a knob of the EAGLE-3 methods)",
    "train.loss_decay": "draft.loss_decay (a knob of the EAGLE-3 methods)",
    **{f"target.kimi_{name}": f"target.kimi.{name} (the Kimi renderer's options, target.kimi.*)" for name in (
        "default_system", "declare_tools", "tool_call_ids", "tool_call_index", "tool_arguments", "keep_reasoning",
        "supervise_history", "missing_reasoning", "add_bos")},
    "eval.dflash_blocks": "eval.chains: a DFlash head is served at a block of each distinct num_draft_tokens "
                          "there (e.g. 'eval.chains=[[3,1,4],[7,1,8]]' serves blocks 4 and 8)",
}


def config_keys(schema=None) -> dict[str, bool]:
    """Every field's dotted key of `schema` (JobConfig or EvalJobConfig, the default) and of every
    draft method's config: True for a dict field, whose own keys are free (`+eval.heads.NAME=FOLDER`)."""
    import dataclasses

    keys: dict[str, bool] = {}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if prefix == "" and f.name == "draft":
                continue
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                keys[prefix + f.name] = isinstance(default, dict)

    walk(schema or EvalJobConfig, "")
    for method in METHODS.values():
        walk(method.spec_class, "draft.")
    return keys


def check_moved_keys(overrides: list[str], schema=None) -> None:
    """ValueError, one line, for an override of a key that is not a config field (`+key=value`
    included, which Hydra would add unread): naming the new key for a key of MOVED_KEYS, else the
    closest field (`schema`: JobConfig for train, EvalJobConfig, the default). Group choices (`target=...`, `+hw=...`) and `hydra.*` are Hydra's own."""
    import difflib

    keys = None
    for override in overrides:
        if override.startswith("-"):
            continue
        key = override.split("=", 1)[0].lstrip("+~")
        if key in MOVED_KEYS:
            raise ValueError(f"{key} is no longer a config key; use {MOVED_KEYS[key]}")
        if "." not in key or key.startswith("hydra."):
            continue
        keys = keys if keys is not None else config_keys(schema)
        parts = key.split(".")
        if key in keys or any(keys.get(".".join(parts[:n])) for n in range(1, len(parts))):
            continue
        close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
        group = [k for k in keys if k.startswith(parts[0] + ".")]
        hint = f"did you mean {close[0]}?" if close else (f"the {parts[0]}.* fields: {', '.join(group[:8])} ..."
                                                          if group else "no config group of that name")
        raise ValueError(f"{override.split('=', 1)[0]} is not a config field ({hint}); --help lists every field")


def check_composed(cfg) -> None:
    """ValueError naming a key of the composed config (a DictConfig) that its schema lacks: a
    `+draft.KEY` of another draft method than the one composed, which Hydra adds and nothing reads."""
    import dataclasses
    import difflib

    from omegaconf import DictConfig, OmegaConf

    def walk(node, prefix: str) -> None:
        cls = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(cls):
            return
        names = {f.name for f in dataclasses.fields(cls)}
        for key in node.keys():
            if key not in names:
                close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.5)
                hint = f"did you mean {prefix}{close[0]}?" if close else f"{cls.__name__} has no such field"
                raise ValueError(f"{prefix}{key} is not a config field of this run ({hint}); --help lists every field")
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                walk(child, f"{prefix}{key}.")

    walk(cfg, "")


def one_line(err: BaseException) -> str:
    """A Hydra or OmegaConf error as one line: its first line and its cause's."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        text += f" ({str(cause).strip().splitlines()[0]})"
    return text


def run_hydra_main(main) -> None:
    """Call a `@hydra.main` function with Hydra's and OmegaConf's errors (an unknown group option,
    a value of the wrong type, an override that does not parse) raised to here instead of printed
    at length by Hydra, and reported as one line, exit code 2, as the project's own config errors."""
    import os
    import sys

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing a traceback and exiting 1
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        print(f"\nerror: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


def compose_job(overrides: list[str], config_name: str = "config"):
    """The JobConfig `python -m specforge_k25.train` composes from the same overrides, without a
    Hydra output folder (the plan and TP-node CLIs, tests)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    check_moved_keys(overrides, EvalJobConfig if config_name == "eval" else JobConfig)
    register_schemas()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
        check_composed(cfg)
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as err:  # one line, as the project's own errors
        raise ValueError(one_line(err)) from None


def register_schemas() -> None:
    """The typed schemas the YAML files extend (`defaults: [job_schema, ...]`): unknown keys and
    wrong types fail at composition; and `${first_set:a,b}` (a unless null, else b), with which
    conf/eval.yaml puts Hydra's run folder at eval.output when one is given."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("first_set"):
        OmegaConf.register_new_resolver("first_set", lambda first, then: then if first is None else first)

    store = ConfigStore.instance()
    for schema, cls in (("job_schema", JobConfig), ("eval_schema", EvalJobConfig)):
        node = OmegaConf.structured(cls)
        node.draft = "???"  # the draft group fills it with a method's own config (of any type)
        store.store(name=schema, node=node)
    check_profile_names()
    for name, method in METHODS.items():  # `draft=<name>`: the method's config at its defaults
        store.store(group="draft", name=name, node=method.spec_class)
