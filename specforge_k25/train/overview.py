"""What a run prints: the plan of the run before the engine starts, one line per evaluation."""
from __future__ import annotations

from pathlib import Path

from ..config import JobConfig
from ..plan import PlanError, TargetFacts, facts_from_folder, predict, with_hw_overrides
from ..plan.budget import node_layout, trainer_seq_len
from ..plan.engine import prefill_chunk
from ..plan.pipeline import env_partition, predict_pipeline
from ..setup.run import RunSetup
from .schedule import BatchItem, padding_share


# Embedded targets with seeded random weights (target_engine/models.py): their argmax tokens are
# almost never in a draft vocabulary built from the data, so a run on one learns nothing.
RANDOM_BUILTINS = ("tiny_deepseek", "tiny_kimi")


def random_target_note(target) -> str | None:
    """The line a run on a random embedded target prints beside its plan and its results."""
    if target.path or target.builtin not in RANDOM_BUILTINS:
        return None
    return (f"target {target.name} is a random tiny fixture: acceptance ~0 is expected (its argmax tokens are "
            "almost never in the draft vocabulary built from the data); it exercises Kimi's code path, not learning")


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def eval_line(ev: dict, K: int) -> str:
    accs = " ".join(f"{ev[f'acc_{k}']:.3f}" for k in range(K))
    return f"tau_sim {ev['tau_sim']:.3f}  acc_0..{K - 1} [{accs}]  positions {int(ev['positions'])}"


def throughput_line(job: JobConfig, facts: TargetFacts, padding: float) -> str | None:
    """The node tokens/s the throughput plan predicts at the schedule's padding share and with none,
    or None where the hw profile has no throughput inputs (the cpu profile)."""
    hw = job.hw

    def rate(share: float) -> float:
        if hw.target_pp > 1:
            return predict_pipeline(job, facts, hw.target_pp, hw.target_tp, hw.num_gpus // (hw.target_pp * hw.target_tp),
                                    env_partition(facts.num_layers, hw.target_pp), memory=False,
                                    padding_share=share).throughput.tokens_per_s
        return predict(job, facts, padding_share=share).tokens_per_s

    try:
        padded, full = rate(padding), rate(0.0)
    except PlanError:
        return None
    return (f"throughput  planned {padded:,.0f} tokens/s per node at this schedule's {padding:.0%} padding "
            f"({full:,.0f} with none: {padded / full:.2f} of it; `python -m specforge_k25.plan` has the parts)")


def print_overview(job: JobConfig, setup: RunSetup, schedule: list[BatchItem], steps: int, draft, run_dir: Path,
                   world: int = 1) -> None:
    """What the run is about to do, printed before the engine starts."""
    trainable = sum(p.numel() for p in draft.trainable_parameters())
    train_items = [p for p in schedule if p.kind == "train"]
    train_tokens = sum(len(setup.data.train[i].input_ids) for p in train_items for i in p.sample_ids
                       if i < len(setup.data.train))
    H = setup.info.hidden_size
    padding = padding_share(schedule, [len(s.input_ids) for s in setup.data.train], job.train.batch_size)
    depth = setup.method.depth(job.draft, setup.draft_cfg)
    chunk = prefill_chunk(job.hw)  # what the engine runs (setup/target.py): SGLang's own on cuda when null
    lines = [
        "== specforge_k25 run plan ==",
        f"target      {job.target.name}: {setup.info.architecture}, {setup.info.num_layers} layers, hidden {H}, "
        f"vocab {setup.info.vocab_size} ({setup.model_path})",
        f"engine      SGLang in its own process, device {job.hw.device}, TP {job.hw.target_tp}{f' x {job.hw.target_pp} pipeline stages' if job.hw.target_pp > 1 else ''}, {job.hw.target_dtype}, prefill {f'in chunks of {chunk} tokens' if chunk else 'one forward per batch'}",
        f"aux layers  inputs of layers {setup.capture_points} (SGLang's ids {setup.sglang_capture_ids})",
        f"draft       {setup.method.name}: {setup.method.describe(setup.draft_cfg)}; {_fmt_params(trainable)} "
        f"trainable (+{_fmt_params(draft.embed_tokens.weight.numel())} frozen embedding)",
        f"data        {len(setup.data.train)} train / {len(setup.data.heldout)} held-out samples"
        f"{'' if setup.data.heldout else ' (no held-out evaluation: data.heldout_samples=0)'}, max_length "
        f"{job.data.max_length} ({setup.data.truncated} cut there, {setup.data.turns_dropped} as their later turns); "
        f"skipped {dict(setup.data.skipped) or 'none'}",
        f"schedule    {steps} optimizer steps = {len(train_items)} micro-batches of {job.train.batch_size} "
        f"x accum {job.train.grad_accum}, {train_tokens} tokens, "
        f"{padding:.0%} padding"
        f"{' (grouped by length)' if job.train.group_by_length and job.train.batch_size * world > 1 else ''}; depth {depth}; lr {job.train.lr}",
        f"stream      {job.train.stream_slots} shared-memory slots of up to "
        f"{job.train.batch_size * trainer_seq_len(job.hw, job.data.max_length, depth)} tokens x "
        f"{(setup.method.num_aux(setup.draft_cfg) + 1) * H} floats",
        f"outputs     {run_dir}",
    ]
    note = random_target_note(job.target)
    if note:
        lines.insert(2, f"note        {note}")
    planned = throughput_line(job, with_hw_overrides(job.hw, facts_from_folder(setup.model_path, job.target.name)), padding)
    if planned:
        lines.insert(-2, planned)
    layout = node_layout(job.hw)
    cp = job.hw.context_parallel
    def sharded() -> str:  # co-located only
        return f"draft sharded {world} ways (FSDP2)" + (
            f", the target's lm_head split {world} ways by vocabulary rows" if setup.method.shards_target_head else "")

    if world > 1 and layout.colocated and cp > 1:
        lines.insert(-2, f"ranks       {world} co-located trainer ranks, one beside each TP rank of {world // layout.per_replica} "
                         f"replica(s), in {world // cp} group(s) of {cp} that split every sequence's positions "
                         f"(hw.context_parallel; Ulysses attention); global batch {world // cp} x {job.train.batch_size} "
                         f"samples, shared out to the groups balanced by tokens; {sharded()}")
    elif world > 1 and layout.colocated:
        tp = layout.per_replica
        beside = f"each of the {layout.pp} pipeline stages' TP ranks" if layout.pp > 1 else "each TP rank"
        lines.insert(-2, f"ranks       {world} co-located trainer ranks, one beside {beside} of {world // tp} "
                         f"replica(s); global batch {world} x {job.train.batch_size} samples, each replica's "
                         f"{tp * job.train.batch_size} shared out balanced by tokens; {sharded()}")
    elif world > 1:
        lines.insert(-2, f"ranks       {world} data-parallel trainer ranks, one target replica each; global batch "
                         f"{world} x {job.train.batch_size} samples, sliced by rank")
    print("\n".join(lines), flush=True)
