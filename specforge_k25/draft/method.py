"""The draft-method interface: everything train, plan, export, eval and the stream ask of a way of
drafting, so that none of them names one. A method is one folder under `draft/` (its config,
model, objective, plan, export and serving) plus an entry in `draft/registry.py`; the `draft`
config group picks it (`draft=dflash`: the `draft.*` fields are then that method's config).

A method's model is a plain `nn.Module` with
    embed_tokens     the target's embedding [V, H], frozen (never checkpointed or exported)
    d2t, t2d         draft vocab maps (draft/vocab.py)
    trainable_parameters()
and the method says how to build it, train it, size it for the plan, export it and serve it.

`spec` is the method's `draft.*` config (its `spec_class`, a draft/spec.py DraftSpec), `cfg` the
model config `resolve_config` makes of it; `target` is duck-typed, the target's facts (plan/facts.py
TargetFacts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .spec import DraftSpec


@dataclass
class DraftBatch:
    """One micro-batch as a method's loss reads it (train/step.py builds it from the stream)."""

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
    seeds: list | None = None  # one seed per sequence for `prepare_batch`'s draws (train/step.py batch_seed of
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

    # ------------------------------------------------------------------ shape
    def resolve_config(self, spec, target, num_aux: int = 3) -> Any:
        """The model config from `draft.*`, the target's facts and the number of capture points the
        run asks for (target.aux_layers); unset sizes follow the target. A method that cannot read
        `num_aux` states raises ValueError saying so."""
        raise NotImplementedError

    def num_aux(self, cfg) -> int:
        """K >= 0: the captured target states (inputs of K decoder layers) the model reads per token,
        side by side [T, K*Ht]; the stream always carries the target's final state too (the
        teacher's input, and `final_hidden` for a method that reads it)."""
        raise NotImplementedError

    def new_model(self, cfg) -> nn.Module:
        """The method's model for `cfg`, freshly initialised (callers use `build`)."""
        raise NotImplementedError

    def build(self, cfg, *, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None) -> nn.Module:
        """The model for `cfg` with the target's frozen pieces when given: `embed` [V, H] copied into
        its embed_tokens, `lm_head` [V, Ht] attached where the model computes with it (`attach_target`)."""
        model = self.new_model(cfg)
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

    def reserved_token_ids(self, cfg) -> list[int]:
        """Token ids real input must never contain (DFlash: its mask token); setup refuses data with them."""
        return []

    def with_unused_special_tokens(self, spec, unused: list[int]):
        """The draft spec with its reserved tokens, where left unset, chosen among `unused`: the
        tokenizer's special-token ids (ascending) that the data never holds and that are not its
        bos / eos / pad / end-of-turn. Default: the spec as given (nothing reserved)."""
        return spec

    def fsdp_units(self, model: nn.Module) -> list[str]:
        """Names of the trainable submodules, each sharded on its own (train/sharding.py)."""
        raise NotImplementedError

    def describe(self, cfg) -> str:
        """One line for the plan a run prints."""
        raise NotImplementedError

    # --------------------------------------------------------------- training
    def depth(self, spec, cfg) -> int:
        """How many positions per token the loss counts: the length of its LossResult counters
        (acc_0..depth-1, the data-parallel normalizer). EAGLE-3: the TTT unroll, draft.ttt_length."""
        raise NotImplementedError

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
    # `plan`: a module of the method's folder with the arithmetic the memory and throughput plans
    # (plan/) read, each taking the method's config:
    #   param_counts(cfg) -> {module: parameters}, '(frozen)' names not trained
    #   step_bytes(cfg, batch, seq_len, k, bf16) -> (bytes of the B*T tokens, mask bytes) step k keeps
    #   saved_bytes(cfg, batch, seq_len, depth, bf16, checkpoint=False) -> {"per_token": bytes linear in T,
    #     "attention_mask": bytes of masks (0: none), "total": both}
    #   backward_working_bytes(cfg, batch, seq_len, depth, bf16) -> bytes
    #   draft_step_flops(cfg, batch, seq_len, depth, checkpoint=False) -> {"teacher", ..., "total"}
    #   context_parallel_values(cfg, size, depth) -> values a rank sends per position it holds, forward
    #     (methods with `context_parallel` only)
    #   split_head_bytes(cfg, shards, bf16) -> bytes of the exchange buffers of one logits chunk with
    #     the lm_head split over `shards` ranks (methods with `shards_target_head` only)
    # A "step" is what the method unrolls or stacks: EAGLE-3's TTT step, DFlash's draft layer (what
    # per-layer activation checkpointing recomputes at a time; its depth arguments are unused).
    plan: Any = None

    # ----------------------------------------------------------------- export
    def serving_tensors(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def serving_config(self, cfg, *, sglang_layer_ids: list[int], vllm_layer_ids: list[int], bos_token_id,
                       eos_token_id, dtype: str) -> dict:
        raise NotImplementedError

    def validate_export(self, export_dir: Path) -> None:
        """Raise ValueError naming every problem of an export folder."""
        raise NotImplementedError

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor) -> nn.Module:
        raise NotImplementedError

    # ------------------------------------------------------------------ serve
    vllm_method: str = ""  # vLLM speculative_config "method" that serves the export

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


# What a method must define itself (the base raises NotImplementedError), and what its `plan`
# module must hold: `method_problems` checks both when the registry takes a method.
REQUIRED = ("resolve_config", "num_aux", "new_model", "fsdp_units", "describe", "depth", "loss", "loss_positions",
            "serving_tensors", "serving_config", "validate_export", "load_export")
PLAN_FUNCTIONS = ("param_counts", "step_bytes", "saved_bytes", "backward_working_bytes", "draft_step_flops")


def method_problems(method: DraftMethod) -> list[str]:
    """Every way `method` falls short of the interface: unset names and classes, members it does
    not define, plan arithmetic it lacks (empty: it plugs in)."""
    import dataclasses

    cls = type(method)
    problems = [f"{attr} is not set" for attr in ("name", "served_architecture") if not getattr(method, attr)]
    if not (isinstance(method.spec_class, type) and issubclass(method.spec_class, DraftSpec)
            and method.spec_class is not DraftSpec and dataclasses.is_dataclass(method.spec_class)):
        problems.append("spec_class must be its own dataclass extending draft/spec.py DraftSpec (its draft.* "
                        "config, by which the registry knows the method of a config)")
    if not (isinstance(method.model_class, type) and issubclass(method.model_class, nn.Module)
            and method.model_class is not nn.Module):
        problems.append("model_class must be its nn.Module subclass")
    if method.config_class is object:
        problems.append("config_class (what resolve_config returns) is not set")
    problems += [f"{name}() is not defined" for name in REQUIRED if getattr(cls, name) is getattr(DraftMethod, name)]
    problems += [f"plan.{name} is missing" for name in PLAN_FUNCTIONS if not callable(getattr(method.plan, name, None))]
    if method.shards_target_head and not callable(getattr(method.plan, "split_head_bytes", None)):
        problems.append("plan.split_head_bytes is missing (shards_target_head)")
    return problems


def trainable_count(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if not name.endswith("(frozen)"))


def draft_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint and the serving export hold: trainable weights + vocab maps; the frozen
    target embedding is left out (the target's own is used)."""
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if not k.startswith("embed_tokens.")}
