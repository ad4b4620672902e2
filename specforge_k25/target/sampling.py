"""Answer regeneration settings and the one sampling rule every engine uses, so the SGLang engine
and the HF reference generate the same answers for the same logits, on every TP rank alike.

A request's random stream is seeded from the run's seed and the prompt's token ids: reproducible
across runs, resumes and TP ranks without any extra communication.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Regeneration:
    """How the target answers each prompt (picklable: it travels to the target processes)."""

    max_new_tokens: int = 128
    max_length: int = 256  # prompt + answer never exceed data.max_length
    temperature: float = 0.0  # 0: greedy, as the acceptance-length eval decodes
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)  # end-of-turn / eos: the answer ends with it
    group_sequences: int = 16  # prompts decoded together, ahead of training

    def budget(self, prompt_len: int) -> int:
        """New tokens a prompt may get: the served limit, and the room left below max_length."""
        return max(0, min(self.max_new_tokens, self.max_length - prompt_len))


def request_generator(seed: int, prompt: torch.Tensor) -> torch.Generator:
    """The random stream of one request: a function of the seed and the prompt's token ids."""
    key = zlib.crc32(prompt.to(torch.int64).numpy().tobytes(), seed & 0xFFFFFFFF)
    return torch.Generator().manual_seed(key)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """logits [B, V] (any device) -> next token ids [B] int64 on the CPU.

    temperature 0: argmax. Otherwise softmax(logits / T) restricted to the smallest set of tokens
    whose probability reaches top_p (ties broken towards lower ids), then one draw per row from
    that row's generator (float64 on the CPU, so every engine and rank draws the same token)."""
    logits = logits.detach().to("cpu", torch.float64)
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    out = torch.empty(len(probs), dtype=torch.int64)
    for b, (row, gen) in enumerate(zip(probs, generators)):
        order = torch.argsort(row, descending=True, stable=True)
        sorted_p = row[order]
        keep = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # the token that crosses top_p is kept
        kept = sorted_p[:keep] / sorted_p[:keep].sum()
        out[b] = order[int(torch.multinomial(kept, 1, generator=gen))]
    return out


def generate_with(step, prompts: list[torch.Tensor], budgets: list[int], regen: Regeneration) -> list[list[int]]:
    """The decode loop both engines share. `step(tokens | None)` runs the engine: None = prefill
    the prompts, else feed one token per request; it returns next-token logits [B, V]. A request
    stops at a stop id (kept as its last token) or after its budget of new tokens; the batch keeps
    decoding until every request has stopped (finished requests' tokens are ignored)."""
    generators = [request_generator(regen.seed, p) for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    done = [b <= 0 for b in budgets]
    logits = step(None)
    while not all(done):
        tokens = sample_next(logits, regen.temperature, regen.top_p, generators)
        for b, t in enumerate(tokens.tolist()):
            if done[b]:
                continue
            answers[b].append(t)
            done[b] = t in regen.stop_ids or len(answers[b]) >= budgets[b]
        if all(done):
            break
        logits = step(tokens)
    return answers
