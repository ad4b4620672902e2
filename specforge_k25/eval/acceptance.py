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

from ..draft.objective import simulated_acceptance_length

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


def draft_proposer(predictions: torch.Tensor) -> Proposer:
    """Proposals [depth, T] of a head at every root (`DraftMethod.proposals`)."""
    table = predictions.tolist()

    def propose(root: int) -> list[int]:
        return [row[root - 1] for row in table]

    return propose


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
