"""Acceptance length under greedy verification, replayed on a greedy output.

With temperature 0 the target's output does not depend on the drafter, and a verify step
accepts exactly the longest prefix of the proposal that equals that output. So, given the
output and what a drafter would propose at each step, the acceptance length SGLang reports
can be replayed step by step, with SGLang's accounting: the token the prefill produces counts
as a completion token but not as a verify step, AL = Σ completion tokens / Σ verify steps.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..draft.loss import _shift, simulated_acceptance_length
from ..draft.vocab import draft_to_target

Proposer = Callable[[int], list[int]]  # index of the last committed token -> proposed next tokens


def replay(sequence: list[int], prompt_len: int, propose: Proposer) -> tuple[int, int]:
    """-> (completion tokens, verify steps) for `sequence` = prompt + greedy completion."""
    n = len(sequence) - prompt_len
    if n <= 0:
        return 0, 0
    root, steps = prompt_len, 0  # sequence[root] is the token the last step (or the prefill) committed
    while root < len(sequence) - 1:
        accepted = 0
        for token in propose(root):
            if root + 1 + accepted >= len(sequence) or token != sequence[root + 1 + accepted]:
                break
            accepted += 1
        root += accepted + 1  # the accepted drafts and the target's bonus token
        steps += 1
    return n, steps


def prompt_lookup_proposer(sequence: list[int], num_tokens: int, ngram_max: int = 3, ngram_min: int = 1) -> Proposer:
    """Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the context's last
    n tokens (longest n first) and propose the `num_tokens` tokens that followed it."""

    def propose(root: int) -> list[int]:
        context = sequence[: root + 1]
        for n in range(min(ngram_max, len(context) - 1), ngram_min - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest match first, never the tail itself
                if context[start:start + n] == tail:
                    return context[start + n: start + n + num_tokens]
        return []

    return propose


CHAIN_SURFACE = ("project", "step", "logits", "d2t")  # what draft_predictions calls


def can_replay(draft) -> bool:
    """Whether `draft_predictions` can run the model: a chain drafter with the TTT surface of the
    EAGLE-3 heads (draft/model.py, draft/eagle3_mla/model.py)."""
    return all(hasattr(draft, name) for name in CHAIN_SURFACE)


@torch.no_grad()
def draft_predictions(draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The draft's chain proposals at every position, teacher-forced as in training (TTT).

    aux_hidden [T, K*Ht], input_ids [T] -> target token ids [steps, T]: row k, column t is what
    draft step k proposes for x[t+k+2] when x[..t+1] is committed (x[t+1] the root). Under
    greedy verification the inputs of an accepted chain ARE the output tokens, so these are
    exactly the proposals SGLang's draft makes at a verify step whose root is x[t+1].
    `step`'s cache entries (K/V, or MLA's latent and roped key) are kept for the later steps, as in training.
    """
    ids = input_ids[None]  # [1, T]
    positions = torch.arange(ids.shape[1])[None]
    dtype = next(p.dtype for p in draft.parameters() if p.is_floating_point())
    hidden = draft.project(aux_hidden[None].to(dtype))  # [1, T, H]
    cache: list = []
    to_target = draft_to_target(draft.d2t)
    rows = []
    for k in range(steps):
        hidden, kv = draft.step(_shift(ids, k + 1, 0), hidden, positions + k, cache)
        cache.append(kv)
        rows.append(to_target[draft.logits(hidden).argmax(-1)][0])  # [T]
    return torch.stack(rows)


def draft_proposer(predictions: torch.Tensor) -> Proposer:
    """Proposals from `draft_predictions` or `block_predictions` (depth = its row count)."""
    table = predictions.tolist()

    def propose(root: int) -> list[int]:
        return [row[root - 1] for row in table]

    return propose


def can_replay_blocks(draft) -> bool:
    """Whether `block_predictions` can run the model: a block drafter (draft/dflash/model.py)."""
    return hasattr(draft, "draft_block")


@torch.no_grad()
def block_predictions(draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, block_size: int,
                      queries_per_chunk: int = 512) -> torch.Tensor:
    """The block drafter's proposals at every root, as SGLang's DFLASH worker drafts them, in
    `draft_predictions`' layout (so `draft_proposer` and `step_counts` read both).

    aux_hidden [T, K*Ht], input_ids [T] -> target token ids [block_size - 1, T]: column t holds
    what the drafter proposes for x[t+2..t+B] when x[..t+1] is committed, x[t+1] the last
    accepted token: the block [x[t+1], MASK x (B-1)] at positions t+1..t+B over the context's
    states x[0..t] (draft/dflash/model.py `draft_block`). Under greedy verification the
    committed tokens ARE the output, so these are the proposals of the verify step whose root
    is x[t+1]. All roots are drafted in one forward per chunk of blocks (the model's block
    attention: no [Q, T+Q] mask), which equals one `draft_block` per root. The last column (no
    root) stays -1.
    """
    T, B = len(input_ids), block_size
    dtype = next(p.dtype for p in draft.parameters() if p.is_floating_point())
    aux = aux_hidden[None].to(dtype)
    ctx_positions = torch.arange(T)
    to_target = draft_to_target(draft.d2t)
    out = torch.full((B - 1, T), -1, dtype=torch.int64)
    for roots in torch.arange(1, T).split(max(1, queries_per_chunk // B)):
        n = len(roots)
        ids = torch.full((n, B), draft.cfg.mask_token_id, dtype=torch.int64)
        ids[:, 0] = input_ids[roots]
        positions = roots[:, None] + torch.arange(B)
        # each block sees the context before its root and itself, both directions
        hidden = draft(aux, ctx_positions[None], ids.view(1, -1), positions.view(1, -1), prefix=roots[None])[0]
        drafted = hidden.view(n, B, -1)[:, 1:]  # block positions 1..B-1 draft x[r+1..r+B-1]
        out[:, roots - 1] = to_target[draft.logits(drafted).argmax(-1)].T
    return out


def step_counts(predictions: torch.Tensor, sequence: list[int], prompt_len: int) -> tuple[list[int], list[int]]:
    """(correct_k, scored_k) as training counts acc_k: completion positions where step k's
    proposal equals the output token, all earlier tokens given. Labels start after the token
    the prefill produced (no draft proposes it)."""
    seq = torch.tensor(sequence)
    t = torch.arange(len(seq))
    correct, scored = [], []
    for k, row in enumerate(predictions):
        label = t + k + 2
        valid = (label < len(seq)) & (label >= prompt_len + 1)
        correct.append(int((row[valid] == seq[label[valid]]).sum()))
        scored.append(int(valid.sum()))
    return correct, scored


def tau_sim(correct: list[int], scored: list[int]) -> float:
    """τ_sim from summed counts, as training reports it."""
    return simulated_acceptance_length([c / max(s, 1) for c, s in zip(correct, scored)])
