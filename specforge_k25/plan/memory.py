"""The memory items of one trainer rank: what the draft, its optimizer and the TTT objective
hold on a GPU, phase by phase, for a batch of B sequences of T tokens.

Sources: the trainer as it stands (train/learner.py, train/optim.py, the draft method's model,
draft/eagle3/loss.py):
the draft lives in fp32 with fp32 grads (`hw.autocast=bf16` computes in bf16 and caches bf16
weight copies until backward); AdamW's m/v sit next to it (the fp32 weights are the master copy)
or, with `train.optimizer_device`, on the host or another GPU with their own fp32 master and
gradient copies; the frozen embedding [V, H] (in host memory: train/host_embedding.py) and the
target's lm_head [V, Ht] keep the target's dtype; the teacher holds [B, T, Vd] fp32 draft logits; each TTT step keeps its activations
([B, T, Vd] fp32 log-probs and teacher probs, the fused attention's q/K/V/out and logsumexp, for
EAGLE-3 steps k >= 1 also the k diagonal scores and keys/values of draft/eagle3/ttt_attention.py, no mask;
a method with an attention mask counts it apart; never [B, nh, T, T] probabilities) or, with
`train.activation_checkpointing`,
only its inputs and recomputes one step at a time in backward. The draft method counts those
tensors (its `plan` module: `saved_bytes`, exact against saved-tensor hooks in the tests;
`backward_working_bytes`, an estimate); the runtime reserves are estimates. The co-located layout
(hw.trainer_layout=colocated) shards the trainable state over the trainer ranks with FSDP2
(train/sharding.py; `_sharded_trainer_items`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..draft.method import DraftMethod
from .facts import GiB, method_of_config, trainable_params

PHASE_TEACHER, PHASE_DRAFT, PHASE_OPT = "teacher", "draft fwd+bwd", "optimizer step"


@dataclass
class Item:
    name: str
    bytes: int
    phase: Optional[str] = None  # None: resident; else only the largest phase of a GPU counts
    note: str = ""
    owner: str = "trainer"  # trainer | target | stream


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def optimizer_items(P: int, on_gpu: bool) -> list[Item]:
    """train.optimizer_device: what OffloadedAdamW (train/optim.py) holds on its own device. The
    master copies and gradient copies are allocated when the trainer is built; m, v on the first
    step. On a GPU torch's foreach AdamW adds temporaries; on the host the fused kernel does not."""
    items = [
        Item("AdamW master weights fp32", 4 * P),
        Item("AdamW gradient copies fp32", 4 * P),
        Item("AdamW m, v fp32", 8 * P),
    ]
    if on_gpu:
        items.append(Item("AdamW foreach temporaries fp32", 4 * P, PHASE_OPT))
    return items


def host_optimizer_note(P: int, ranks: int) -> str:
    host = sum(i.bytes for i in optimizer_items(P, on_gpu=False)) * ranks
    return (f"optimizer on the host (train.optimizer_device=cpu): {gib(host)} of pinned host memory for "
            f"{ranks} rank(s) (fp32 master, gradient copies, m, v); each optimizer step copies "
            f"{gib(8 * P)} over PCIe (grads in, weights out) and runs fused AdamW on the CPU: raise "
            f"train.grad_accum to amortise it, or put it on a GPU with room (train.optimizer_device=cuda:N)")


def offload_note(P: int, ranks: int, keep_gathered: bool) -> str:
    gathers = "one all-gather" if keep_gathered else "two all-gathers (forward, backward)"
    return (f"co-located shards on the host (train.optimizer_device=cpu, FSDP2's CPU offload): {gib(16 * P)} of pinned "
            f"host memory over {ranks} rank(s) (fp32 weights, grads, m, v); per unit and micro-batch {gathers} copy "
            f"its fp32 shard up and its reduce-scatter the grad shard down, and each rank runs AdamW on its shard on "
            f"the CPU")


def step_bytes(cfg, batch: int, seq_len: int, k: int, bf16: bool, method: DraftMethod | None = None):
    """(bytes, mask bytes) TTT step k of the draft saves for backward (its method's count)."""
    return _method(cfg, method).plan.step_bytes(cfg, batch, seq_len, k, bf16)


def saved_bytes(cfg, batch: int, seq_len: int, ttt_length: int, bf16: bool, checkpoint: bool = False,
                    method: DraftMethod | None = None) -> dict[str, int]:
    """{"per_token", "attention_mask", "total"}: bytes all K TTT steps leave saved for backward."""
    return _method(cfg, method).plan.saved_bytes(cfg, batch, seq_len, ttt_length, bf16, checkpoint)


def _method(cfg, method: DraftMethod | None) -> DraftMethod:
    return method if method is not None else method_of_config(cfg)


def trainer_items(cfg, *, batch: int, seq_len: int, ttt_length: int, teacher_chunk: int, bf16: bool,
                  data_parallel: bool, context_bytes: int, frozen_bytes: int = 4, checkpoint: bool = False,
                  optimizer_offloaded: bool = False, shards: int = 1, method: DraftMethod | None = None) -> list[Item]:
    """One trainer rank's memory on its GPU. Resident items are allocated before the target starts
    (weights, frozen tensors) or persist across steps (grads, AdamW state); phase items are peaks of
    the three phases of a micro-batch, which do not overlap.

    cfg: the draft method's config (`method`, else the method whose config it is);
    frozen_bytes: element size of the frozen lm_head (the target's dtype; the frozen embedding
    stays on the host, train/host_embedding.py); checkpoint: train.activation_checkpointing;
    optimizer_offloaded: AdamW state elsewhere (`optimizer_items` on train.optimizer_device);
    shards > 1: the co-located layout's draft state sharded over `shards` ranks
    (`_sharded_trainer_items`; optimizer_offloaded: FSDP2's CPU offload; data_parallel does not apply)."""
    method = _method(cfg, method)
    if shards > 1:
        return _sharded_trainer_items(cfg, method, shards, batch=batch, seq_len=seq_len, ttt_length=ttt_length,
                                      teacher_chunk=teacher_chunk, bf16=bf16, context_bytes=context_bytes,
                                      frozen_bytes=frozen_bytes, checkpoint=checkpoint, offloaded=optimizer_offloaded)
    P = trainable_params(cfg, method)
    K = method.num_aux(cfg)
    items = [
        Item("CUDA context (trainer process)", context_bytes),
        Item("draft weights fp32", 4 * P, note=f"{P:,} trainable params" + ("" if optimizer_offloaded else
                                                                            " (= AdamW's master copy)")),
        Item("draft grads fp32", 4 * P),
    ]
    if not optimizer_offloaded:
        items.append(Item("AdamW m, v fp32", 8 * P))
    items += _frozen_items(cfg, frozen_bytes)
    if data_parallel:
        items.append(Item("DP gradient buckets fp32 (DDP, assumed)", 4 * P,
                          note="upper bound: train/learner.py all-reduces each grad in place"))
    items += _teacher_items(cfg, K, batch * seq_len, teacher_chunk, frozen_bytes) if method.needs_teacher else []
    items += [_batch_item(cfg, method, batch * seq_len, PHASE_DRAFT),
              Item("bf16 autocast weight copies", 2 * P if bf16 else 0, PHASE_DRAFT)]
    items += _ttt_items(cfg, method, batch, seq_len, ttt_length, bf16, checkpoint)
    items.append(_batch_item(cfg, method, batch * seq_len, PHASE_OPT))
    if not optimizer_offloaded:
        items.append(Item("AdamW foreach temporaries fp32", 4 * P, PHASE_OPT))
    return [i for i in items if i.bytes]


def unit_params(cfg, method: DraftMethod) -> list[int]:
    """Trainable parameters of each FSDP unit (`DraftMethod.fsdp_units`), largest first: the model
    built on the meta device (no memory, any size)."""
    import torch  # the plan reads shapes only; the model is built without storage

    with torch.device("meta"):
        model = method.new_model(cfg)
    return sorted((sum(p.numel() for p in model.get_submodule(u).parameters() if p.requires_grad)
                   for u in method.fsdp_units(model)), reverse=True)


def _sharded_trainer_items(cfg, method: DraftMethod, shards: int, *, batch: int, seq_len: int, ttt_length: int,
                           teacher_chunk: int, bf16: bool, context_bytes: int, frozen_bytes: int,
                           checkpoint: bool, offloaded: bool = False) -> list[Item]:
    """One co-located trainer rank (hw.trainer_layout=colocated): the draft's trainable state
    sharded over `shards` ranks by FSDP2 (train/sharding.py: `fully_shard` per unit): fp32 master
    weights, grads and AdamW m/v, 1/shards each (the last rank's shard is rounded up), on the GPU
    or, `offloaded` (train.optimizer_device=cpu, FSDP2's CPU offload), in host memory, each
    all-gather copying the unit's fp32 shard up first.

    In a micro-batch, with units kept gathered (DraftMethod.keep_units_gathered, EAGLE-3: the TTT
    loop runs the one decoder layer K times) every unit's parameters are all-gathered in the
    compute dtype and kept until backward ends, and the full fp32 gradient exists before its
    reduce-scatter: both counted whole (an upper bound as if one unit). With units freed after
    their forward and backward (DFlash's layers), two units are gathered at a time (the one
    computing and the next, prefetched) and the largest's grads exist in the compute dtype beside
    its fp32 reduce-scatter input: FSDP2 keeps one reduce-scatter input in flight and waits for
    it before the next unit's reduce-scatter allocates its own (the units share the root's
    communication context; while a unit's grads are computed the previous unit's input, at most
    as large, is the one in flight). The frozen lm_head stays whole on every rank, or, for a method
    that splits it (`shards_target_head`: train/vocab_parallel.py), 1/shards of its rows per rank
    plus one logits chunk's exchange buffers (its plan's `split_head_bytes`)."""
    P = trainable_params(cfg, method)
    K = method.num_aux(cfg)
    shard = -(-P // shards)  # ceil: the largest shard
    a = 2 if bf16 else 4
    items = [Item("CUDA context (trainer process)", context_bytes)]
    if not offloaded:
        items += [
            Item(f"draft weights fp32 (shard 1/{shards})", 4 * shard, note=f"{P:,} trainable params / {shards} ranks "
                                                                              f"(= AdamW's master copy)"),
            Item(f"draft grads fp32 (shard 1/{shards})", 4 * shard),
            Item(f"AdamW m, v fp32 (shard 1/{shards})", 8 * shard),
        ]
    split = shards if method.shards_target_head else 1
    items += _frozen_items(cfg, frozen_bytes, split)
    if split > 1:
        items.append(Item(f"lm_head split {split} ways: one logits chunk's exchange", method.plan.split_head_bytes(
            cfg, split, bf16), PHASE_DRAFT, note="gathered rows [W*c, Ht] and their grads (train/vocab_parallel.py)"))
    items += _teacher_items(cfg, K, batch * seq_len, teacher_chunk, frozen_bytes) if method.needs_teacher else []
    items.append(_batch_item(cfg, method, batch * seq_len, PHASE_DRAFT))
    dtype = 'bf16' if bf16 else 'fp32'
    if method.keep_units_gathered:
        up = 4 * shard if offloaded else 0  # the fp32 shards copied up for the all-gathers
        items += [Item(f"all-gathered draft params {dtype} (FSDP2)", a * P + up, PHASE_DRAFT,
                       note="whole unit, kept from forward through backward"),
                  Item("unsharded grads fp32 before reduce-scatter", 4 * P, PHASE_DRAFT, note="upper bound: one unit")]
    else:
        units = unit_params(cfg, method)
        u1, u2 = units[0], (units[1] if len(units) > 1 else 0)
        up = 4 * -(-(u1 + u2) // shards) if offloaded else 0
        items += [Item(f"all-gathered draft params {dtype} (FSDP2, 2 units)", a * (u1 + u2) + up, PHASE_DRAFT,
                       note=f"largest units {u1:,} + {u2:,} params: freed after each unit's forward and backward"),
                  Item("unsharded grads before reduce-scatter (1 unit)", (a + 4) * u1, PHASE_DRAFT,
                       note=f"{dtype} grads + their fp32 reduce-scatter input (the previous unit's is dropped first)")]
    items += _ttt_items(cfg, method, batch, seq_len, ttt_length, bf16, checkpoint)
    items.append(_batch_item(cfg, method, batch * seq_len, PHASE_OPT))
    if not offloaded:
        items.append(Item(f"AdamW foreach temporaries fp32 (shard 1/{shards})", 4 * shard, PHASE_OPT))
    return [i for i in items if i.bytes]


def _batch_bytes(cfg, num_aux: int, tokens: int, teacher: bool = True, final: bool = False) -> int:
    # DraftBatch: aux fp32 [N, K*Ht], input_ids int64, loss_mask bool; with a teacher (a method that
    # reads one): draft logits fp32 [N, Vd], logsumexp fp32, argmax int64; with the final hidden
    # state (a method that reads it): fp32 [N, Ht]; plus lengths (negligible)
    return tokens * (4 * num_aux * cfg.target_hidden_size + 8 + 1 + ((4 * cfg.draft_vocab_size + 4 + 8) if teacher else 0)
                     + (4 * cfg.target_hidden_size if final else 0))


def _batch_item(cfg, method: DraftMethod, tokens: int, phase: str) -> Item:
    """The DraftBatch the method's loss reads (DraftMethod.needs_teacher, needs_final_hidden)."""
    K, teacher, final = method.num_aux(cfg), method.needs_teacher, method.needs_final_hidden
    return Item(f"batch: aux fp32 [B,T,{K}Ht]" + (" + teacher [B,T,Vd] fp32" if teacher else "")
                + (" + final [B,T,Ht] fp32" if final else ""), _batch_bytes(cfg, K, tokens, teacher, final), phase)


def _frozen_items(cfg, frozen_bytes: int, split: int = 1) -> list[Item]:
    """The frozen tensors on the trainer GPU: the target's lm_head (whole, or `split` > 1: this
    rank's ceil(V / split) rows) and the vocab maps (the frozen embedding is looked up on the
    host: `embedding_host_bytes`)."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    dtype = {2: "bf16", 4: "fp32"}.get(frozen_bytes, f"{frozen_bytes} B")
    rows, what = (V, "[V, Ht]") if split == 1 else (-(-V // split), f"[V/{split}, Ht] (rows split over ranks)")
    return [
        Item(f"target lm_head {what} {dtype} (teacher)", frozen_bytes * rows * cfg.target_hidden_size),
        Item("vocab maps d2t int64 + t2d bool", 8 * Vd + V),
    ]


def embedding_host_bytes(cfg, frozen_bytes: int) -> int:
    """Host memory of one trainer process's frozen embedding [V, H] (train/host_embedding.py)."""
    return frozen_bytes * cfg.vocab_size * cfg.hidden_size


def _teacher_items(cfg, num_aux: int, tokens: int, teacher_chunk: int, frozen_bytes: int) -> list[Item]:
    V = cfg.vocab_size
    batch_bytes = _batch_bytes(cfg, num_aux, tokens)
    # teacher logits: [chunk, V] in the lm_head's dtype, its fp32 copy (not made for fp32) and logsumexp's exp
    chunk_elem = frozen_bytes + (4 if frozen_bytes != 4 else 0) + 4
    return [
        Item(f"batch: aux fp32 [B,T,{num_aux}Ht] + teacher [B,T,Vd] fp32", batch_bytes, PHASE_TEACHER),
        Item("next batch + its final hidden fp32 [B,T,Ht]", batch_bytes + 4 * tokens * cfg.target_hidden_size,
             PHASE_TEACHER, note="built while the previous batch is still referenced"),
        Item("teacher chunk [chunk, V]: logits, fp32 copy, logsumexp", chunk_elem * min(teacher_chunk, tokens) * V
             + 8 * V, PHASE_TEACHER),
    ]


def _ttt_items(cfg, method: DraftMethod, batch: int, seq_len: int, ttt_length: int, bf16: bool,
               checkpoint: bool) -> list[Item]:
    arithmetic, label = method.plan, method.plan_label  # the method's name for its steps ("TTT")
    saved = arithmetic.saved_bytes(cfg, batch, seq_len, ttt_length, bf16, checkpoint)
    items = [
        Item(f"{label} saved: per-token tensors (K steps)", saved["per_token"], PHASE_DRAFT,
             note=("checkpointed: each step's hidden input + its attention cache" if checkpoint else
                   "incl. [B,T,Vd] fp32 log-probs + teacher probs per step")),
    ]
    if saved["attention_mask"] > 0:  # a method with masks (DFlash); EAGLE-3's TTT attention builds none
        items.append(Item(f"{label} saved: attention masks (K steps)", saved["attention_mask"], PHASE_DRAFT))
    if checkpoint:  # backward recomputes one step at a time: the last (largest) one at most
        per_token, mask = arithmetic.step_bytes(cfg, batch, seq_len, ttt_length - 1, bf16)
        items.append(Item(f"{label} one step recomputed in backward", per_token + mask, PHASE_DRAFT,
                          note="activation checkpointing: the largest step's saved tensors"))
    items.append(Item(f"{label} backward working set (estimate)",
                      arithmetic.backward_working_bytes(cfg, batch, seq_len, ttt_length, bf16), PHASE_DRAFT))
    return items


def activation_note(cfg, batch: int, seq_len: int, ttt_length: int, bf16: bool, checkpoint: bool,
                    method: DraftMethod | None = None) -> str:
    """The TTT activations with and without train.activation_checkpointing at this length."""
    method = _method(cfg, method)
    arithmetic = method.plan
    plain = arithmetic.saved_bytes(cfg, batch, seq_len, ttt_length, bf16)["total"]
    kept = arithmetic.saved_bytes(cfg, batch, seq_len, ttt_length, bf16, checkpoint=True)["total"]
    one = sum(arithmetic.step_bytes(cfg, batch, seq_len, ttt_length - 1, bf16))
    state = "on" if checkpoint else "off"
    return (f"{method.plan_label} activations at T={seq_len}, K={ttt_length}: {gib(plain)} kept for backward without activation "
            f"checkpointing; {gib(kept)} kept + {gib(one)} for the one step recomputed with it "
            f"(train.activation_checkpointing, {state}; ~1 more forward)")
