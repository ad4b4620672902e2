"""The draft-method interface: everything train, plan, export, eval and the stream ask of a way of
drafting, so that none of them names one. A method is one folder under `draft/` (its config,
model, objective, plan, export and serving) plus an entry in `draft/registry.py`; the `draft`
config group picks it (`draft=dflash`: the `draft.*` fields are then that method's config).
docs/NEW_METHOD.md walks through a new one (tests/fixtures/mtp_method.py, complete in one file).

The contract (draft/contract.py) is a small core every method defines plus capabilities a method
opts into, each a typed Protocol; `method_problems` checks both, and what shared code reads of the
method's config and model (`CONFIG_FIELDS`, `MODEL_MEMBERS` here), when the registry takes a
method. Everything else has a default here.

A method's model is a plain `nn.Module` with `MODEL_MEMBERS`:
    cfg              its config (the method's `config_class`)
    embed_tokens     the target's embedding [V, H], frozen (never checkpointed or exported)
    d2t, t2d         draft vocab maps (draft/vocab.py)
    trainable_parameters()

`spec` is the method's `draft.*` config (its `spec_class`, a draft/spec.py DraftSpec), `cfg` the
model config `resolve_config` makes of it; `target` is duck-typed, the target's facts (plan/facts.py
TargetFacts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn

from .spec import DraftSpec


@dataclass
class DraftBatch:
    """One micro-batch as a method's loss reads it (train/learner.py builds it from the stream)."""

    input_ids: torch.Tensor  # [B, T] int64, right-padded
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B]
    aux_hidden: torch.Tensor  # [B, T, K*Ht] fp32, K aux states as the stream carries them (K may be 0)
    teacher: Any  # draft/objective.py Teacher: the target's distribution where the loss needs it; None for
    # a method that does not read it (`DraftMethod.needs_teacher` False)
    draws: Any = None  # what the method's `prepare_batch` drew at random for this batch (DFlash: its anchors)
    final_hidden: torch.Tensor | None = None  # [B, T, Ht] fp32, the target's final state (after its norm),
    # for a method that reads it (`DraftMethod.needs_final_hidden`); None otherwise
    seq: Any = None  # train/context_parallel.py SeqShard: this rank holds positions [start, start+L) of the
    # sequences (aux_hidden [B, L, K*Ht], teacher from `start` on); input_ids / loss_mask stay whole. None: all of them
    seeds: list | None = None  # one seed per sequence for `prepare_batch`'s draws (train/learner.py batch_seed of
    # the schedule item and the sample): a sequence draws the same whatever batch or rank it lands in

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class Serving:
    """One speculative setting a head is served and replayed at (`DraftMethod.servings`)."""

    label: str  # the eval table's column: "3/1/4" (a chain), "block 4"
    draft_tokens: int  # tokens a verify step checks, the last accepted one included
    depth: int  # proposals per verify step the replay reads: the rows of `DraftMethod.proposals`
    sglang_args: dict  # sglang.Engine / ServerArgs keywords (speculative_algorithm, ...), without the draft path
    vllm_speculative_config: dict  # vLLM's --speculative-config, without "model" (the export folder)


class DraftPlan(Protocol):
    """The arithmetic the memory and throughput plans (plan/) read of a method: its `plan`, often a
    module of its folder (`plan = plan`), every function taking the method's model config. A "step"
    is what the method unrolls or stacks: EAGLE-3's TTT step, DFlash's draft layer (what per-layer
    activation checkpointing recomputes at a time; its depth arguments are then unused)."""

    def param_counts(self, cfg) -> dict[str, int]:
        """{module: parameters}; '(frozen)' names are not trained."""

    def step_bytes(self, cfg, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
        """(bytes of the B*T tokens, mask bytes) step k keeps for backward."""

    def saved_bytes(self, cfg, batch: int, seq_len: int, depth: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
        """{"per_token": bytes linear in T, "attention_mask": bytes of masks (0: none), "total": both}."""

    def backward_working_bytes(self, cfg, batch: int, seq_len: int, depth: int, bf16: bool) -> int:
        """Bytes backward allocates beyond what forward saved."""

    def draft_step_flops(self, cfg, batch: int, seq_len: int, depth: int,
                         checkpoint: bool = False) -> dict[str, float]:
        """{"teacher", ..., "total"}: FLOPs of one micro-batch (forward, backward, recompute)."""


class ContextParallelPlan(Protocol):
    def context_parallel_values(self, cfg, size: int, depth: int) -> float:
        """Values a rank sends per position it holds, forward (plan/throughput.py)."""


class SplitHeadPlan(Protocol):
    def split_head_bytes(self, cfg, shards: int, bf16: bool) -> int:
        """Bytes of the exchange buffers of one logits chunk with the lm_head split over `shards` ranks."""


class DraftMethod:
    """Base of every draft method (docs/EAGLE3.md §7.1)."""

    name: str = ""  # registry key = the `draft` config group's option
    summary: str = ""  # one line for --help
    served_architecture: str = ""  # `architectures[0]` of the exported config.json
    sglang_algorithm: str = ""  # SGLang `speculative_algorithm` that serves the export
    model_class: type = nn.Module  # what `build` returns (registry.method_of finds a model's method by it)
    config_class: type = object  # what `resolve_config` returns (registry.method_of_config)
    spec_class: type = DraftSpec  # its `draft.*` config: the config group option `draft=<name>` (registry.method_of_spec)
    needs_teacher: bool = True  # the loss reads DraftBatch.teacher (the trainer computes it from the final states)
    needs_final_hidden: bool = False  # the loss reads DraftBatch.final_hidden (an MTP-style head's input)
    context_parallel: bool = False  # the loss takes a DraftBatch whose `seq` splits the positions over ranks
    # co-located FSDP2 units (train/sharding.py): True keeps each unit's gathered weights and
    # unsharded grads from its first forward call to the end of backward (a loop that calls a unit
    # many times, EAGLE-3's TTT: one all-gather and one reduce-scatter per micro-batch); False frees
    # them after each unit's forward and after its backward (units called once each, as a stack of
    # layers: the peak holds about two units instead of the whole draft)
    keep_units_gathered: bool = True
    # co-located: each rank holds 1/W of the target's lm_head rows (train/vocab_parallel.py
    # VocabShard, given to `attach_target`) and the loss scores tokens with the other ranks; for a
    # model whose loss takes the target's whole vocabulary through that head (DFlash)
    shards_target_head: bool = False
    # config fields that bound memory (chunk and tile sizes), not what is learned: a resume may
    # change them (train/fingerprint.py), e.g. to get past an out-of-memory error
    memory_only: tuple[str, ...] = ()
    # model config fields added after checkpoints were first written, with the value an older
    # checkpoint that does not record them meant (train/fingerprint.py compares them so)
    config_recorded_later: dict = {}
    plan_label: str = "draft"  # what the plan calls the steps it sizes ("TTT" for EAGLE-3's unroll)

    # ------------------------------------------------------------------ shape
    def resolve_config(self, spec, target, num_aux: int) -> Any:
        """The model config from `draft.*`, the target's facts and the number of capture points the
        run asks for (target.aux_layers, else `default_capture_points`); unset sizes follow the
        target. A method that cannot read `num_aux` states raises ValueError saying so."""
        raise NotImplementedError

    def default_capture_points(self, spec, num_layers: int) -> list[int] | None:
        """The capture points `target.aux_layers=null` means for this method on a `num_layers`-layer
        target ([] = none: a head that reads only the final state); None = the target's default,
        SGLang's [2, L//2, L-3] (target_engine/layers.py). Default: None."""
        return None

    def num_aux(self, cfg) -> int:
        """K >= 0: the captured target states (inputs of K decoder layers) the model reads per token,
        side by side [T, K*Ht]; the stream always carries the target's final state too (the
        teacher's input, and `final_hidden` for a method that reads it)."""
        raise NotImplementedError

    def new_model(self, cfg) -> nn.Module:
        """The method's model for `cfg`, freshly initialised (callers use `build`). Default: model_class(cfg)."""
        return self.model_class(cfg)

    def build(self, cfg, *, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None) -> nn.Module:
        """The model for `cfg` with the target's frozen pieces when given: `embed` [V, H] copied into
        its embed_tokens, `lm_head` [V, Ht] attached where the model computes with it (`attach_target`)."""
        model = self.new_model(cfg)
        lacking = [m for m in MODEL_MEMBERS if not hasattr(model, m)]
        if lacking:
            raise TypeError(f"draft={self.name}: its model {type(model).__name__} lacks {', '.join(lacking)}, "
                            f"which training reads of every draft (draft/method.py MODEL_MEMBERS)")
        if embed is not None:
            with torch.no_grad():
                model.embed_tokens.weight.copy_(embed.float())
        if lm_head is not None:
            self.attach_target(model, lm_head)
        return model

    def load(self, export_dir: Path, embed_weight: torch.Tensor, lm_head: torch.Tensor | None = None) -> nn.Module:
        """An exported head rebuilt (`load_export`) with the target's embedding, and its lm_head
        attached when given."""
        model = self.load_export(Path(export_dir), embed_weight)
        if lm_head is not None:
            self.attach_target(model, lm_head)
        return model

    def attach_target(self, model: nn.Module, lm_head: torch.Tensor) -> None:
        """Hand `model` the target's frozen lm_head [V, Ht] when it computes with it (never trained,
        checkpointed or exported); `build` and `load` call it, and the learner, which owns the
        lm_head on the trainer's device, after a resume. Default: nothing (the EAGLE-3 heads have
        their own lm_head)."""

    def init_from_target(self, model: nn.Module, spec, lm_head: torch.Tensor) -> None:
        """Start trainable weights of a fresh `model` (its vocab maps set) from the target's frozen
        lm_head [V, Ht] where `spec` asks; a resume loads its checkpoint over them. Default: nothing."""

    def reserved_tokens(self, cfg) -> dict[str, int]:
        """Token ids real input must never contain (DFlash: its mask token), each under the override
        that sets it (`{"draft.<field>": id}`); setup refuses data with them, naming the override."""
        return {}

    def with_unused_special_tokens(self, spec, unused: list[int]):
        """The draft spec with its reserved tokens, where left unset, chosen among `unused`: the
        tokenizer's special-token ids (ascending) that the data never holds and that are not its
        bos / eos / pad / end-of-turn. Default: the spec as given (nothing reserved)."""
        return spec

    def fsdp_units(self, model: nn.Module) -> list[str]:
        """Names of the trainable submodules, each sharded on its own (train/sharding.py). Default:
        the model's children that hold a trainable parameter (the frozen embedding is not one)."""
        return [name for name, child in model.named_children()
                if name != "embed_tokens" and any(p.requires_grad for p in child.parameters())]

    def describe(self, cfg) -> str:
        """One line for the plan a run prints. Default: the method's name and its config's fields."""
        import dataclasses

        fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else vars(cfg)
        return f"{self.name}: " + ", ".join(f"{k} {v}" for k, v in fields.items())

    # --------------------------------------------------------------- training
    def depth(self, spec, cfg) -> int:
        """How many positions per token the loss counts: the length of its LossResult counters
        (acc_0..depth-1, the data-parallel normalizer). EAGLE-3: the TTT unroll, draft.ttt_length.
        Default: 1 (one prediction per position)."""
        return 1

    def objective_fingerprint(self, spec) -> dict:
        """The objective's settings that are not in the model config (a resume with one changed is
        refused by name, train/fingerprint.py). Default: none."""
        return {}

    def prepare_batch(self, cfg, batch: DraftBatch, generator: torch.Generator) -> DraftBatch:
        """Draw what the loss draws at random (into `batch.draws`), once per batch before
        `loss_positions` and `loss`: from `batch.seeds` (one per sequence) when the trainer gives
        them, else from its CPU `generator`; a resume draws the same. Default: nothing to draw."""
        return batch

    def loss(self, model: nn.Module, batch: DraftBatch, spec, *, depth: int,
             normalizer: torch.Tensor | None, checkpoint: bool):
        """-> draft/objective.py LossResult (per-depth counters; train/metrics.py sums them)."""
        raise NotImplementedError

    def loss_positions(self, batch: DraftBatch, depth: int) -> torch.Tensor:
        """[depth] int64: the positions each depth's loss is averaged over (the data-parallel normalizer)."""
        raise NotImplementedError

    # -------------------------------------------------------------------- plan
    # the memory and throughput plans' arithmetic; with `context_parallel` also a ContextParallelPlan,
    # with `shards_target_head` a SplitHeadPlan
    plan: DraftPlan | None = None

    def streamed_bytes(self, cfg, elem_bytes: int) -> int:
        """Bytes of target hidden states the stream carries per token for this model: its K capture
        points and the final state (stream/ring.py's slots), `elem_bytes` each value."""
        return (self.num_aux(cfg) + 1) * cfg.target_hidden_size * elem_bytes

    # ----------------------------------------------------------------- export
    def serving_tensors(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The export's tensors. Default: the trainable weights, in `dtype` (a method whose server reads its
        vocab maps or other buffers exports them itself)."""
        return {k: p.detach().to(dtype).contiguous() for k, p in model.named_parameters() if p.requires_grad}

    def serving_config(self, cfg, *, sglang_layer_ids: list[int], vllm_layer_ids: list[int], bos_token_id,
                       eos_token_id, dtype: str) -> dict:
        raise NotImplementedError

    def validate_export(self, export_dir: Path) -> None:
        """Raise ValueError naming every problem of an export folder."""
        raise NotImplementedError

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor) -> nn.Module:
        raise NotImplementedError

    def export_capture_points(self, export_dir: Path) -> list[int] | None:
        """The capture points an export reads (eval picks their columns of the stream); None: unknown,
        the run's own. Default: the vLLM ids its config.json holds at the top level
        (`eagle_aux_hidden_state_layer_ids`, = capture points, which every built-in method writes)."""
        import json

        ids = json.loads((Path(export_dir) / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids")
        return [int(i) for i in ids] if ids else None

    # ------------------------------------------------------------------ serve
    vllm_method: str = ""  # vLLM speculative_config "method" that serves the export ("": vLLM does not)

    @property
    def serves_sglang(self) -> bool:
        """SGLang serves the export (`sglang_algorithm` set): eval runs its speculative decoding."""
        return bool(self.sglang_algorithm)

    def servings(self, chains: list) -> list[Serving]:
        """The settings an export of this method is served at, from the eval's `chains`
        ([num_steps, topk, num_draft_tokens] each, as SGLang's EAGLE arguments); default, a chain
        drafter: one per chain, `num_steps` proposals replayed."""
        out = []
        for steps, topk, draft_tokens in chains:
            out.append(Serving(f"{steps}/{topk}/{draft_tokens}", int(draft_tokens), int(steps),
                               {"speculative_algorithm": self.sglang_algorithm, "speculative_num_steps": int(steps),
                                "speculative_eagle_topk": int(topk), "speculative_num_draft_tokens": int(draft_tokens)},
                               {"method": self.vllm_method, "num_speculative_tokens": int(steps)}))
        return out

    def proposals(self, model: nn.Module, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                  servings: list[Serving], final_hidden: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """Per serving, the model's proposals at every root of a greedy output, as the server drafts
        them under greedy verification: aux_hidden [T, K*Ht], final_hidden [T, Ht] (the target's
        final state after its norm), input_ids [T] -> [depth, T] target
        token ids, column t what a verify step whose root is x[t+1] proposes for x[t+2..]
        (eval/acceptance.py replays them). None: the method has no replay (SGLang's AL only)."""
        return None


# What shared code reads of every model config (plan/memory.py, train/learner.py, setup/run.py) and of
# every model (train/, setup/run.py fresh_draft, export/serving.py): draft/contract.py
# `method_problems` checks the config class's fields and the model class's methods, `build` a model's attributes
CONFIG_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size")
MODEL_MEMBERS = ("cfg", "embed_tokens", "d2t", "t2d", "trainable_parameters")


def trainable_count(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if not name.endswith("(frozen)"))


def draft_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint and the serving export hold: trainable weights + vocab maps; the frozen
    target embedding is left out (the target's own is used)."""
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if not k.startswith("embed_tokens.")}
