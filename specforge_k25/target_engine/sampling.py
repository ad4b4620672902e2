"""Answer regeneration settings and the one sampling rule every engine uses, so the SGLang engine
and the HF reference generate the same answers for the same logits, on every TP rank alike.

A request's random stream is seeded from the run's seed and the prompt's token ids: reproducible
across runs, resumes and TP ranks without any extra communication.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from .pages import whole_pages


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
    that row's generator, in float64 so every engine and rank draws the same token. Where the
    logits are: on the CPU row by row; on a GPU the softmax, sort and cut run there for the whole
    batch (`_nucleus_on_device`) and only the kept tokens' probabilities come to the host for the
    draw (the generators are CPU ones)."""
    if temperature <= 0:  # the float64 conversion is exact: the argmax of the logits as they are
        return logits.detach().argmax(-1).to("cpu", torch.int64)
    if logits.device.type != "cpu":
        return _nucleus_on_device(logits.detach(), temperature, top_p, generators)
    logits = logits.detach().to(torch.float64)
    probs = torch.softmax(logits / temperature, -1)
    out = torch.empty(len(probs), dtype=torch.int64)
    for b, (row, gen) in enumerate(zip(probs, generators)):
        order = torch.argsort(row, descending=True, stable=True)
        sorted_p = row[order]
        keep = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # the token that crosses top_p is kept
        kept = sorted_p[:keep] / sorted_p[:keep].sum()
        out[b] = order[int(torch.multinomial(kept, 1, generator=gen))]
    return out


def _nucleus_on_device(logits: torch.Tensor, temperature: float, top_p: float,
                       generators: list[torch.Generator]) -> torch.Tensor:
    """`sample_next`'s rule for the whole batch where the logits are: one sort of [B, V] and one
    copy to the host of the widest row's kept prefix (all of V at top_p 1), instead of B argsorts
    over V on the host. On the CPU it draws what the row loop draws (tests/target_engine)."""
    probs = torch.softmax(logits.to(torch.float64) / temperature, -1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = ((sorted_p.cumsum(-1) < top_p).sum(-1) + 1).clamp(max=probs.shape[-1])
    width = int(keep.max())
    sorted_p, order, keep = sorted_p[:, :width].cpu(), order[:, :width].cpu(), keep.cpu().tolist()
    out = torch.empty(len(probs), dtype=torch.int64)
    for b, (k, gen) in enumerate(zip(keep, generators)):
        kept = sorted_p[b, :k] / sorted_p[b, :k].sum()
        out[b] = order[b, int(torch.multinomial(kept, 1, generator=gen))]
    return out


def kv_slots(prompt_len: int, budget: int, page_size: int = 1) -> int:
    """KV slots one request of `generate_with` holds at its end (the most it ever holds): its
    prompt and every answer token fed back, i.e. all but the last (a finished request leaves the
    batch, so it stops taking a slot per step); SGLang allocates whole pages per request."""
    return whole_pages(prompt_len + max(budget - 1, 0), page_size)


def generation_slots(prompt_lengths: list[int], budgets: list[int], page_size: int = 1) -> int:
    """The KV pool a `generate_with` call needs at its peak (nothing is freed before its end)."""
    return sum(kv_slots(p, b, page_size) for p, b in zip(prompt_lengths, budgets))


def generate_with(step, prompts: list[torch.Tensor], budgets: list[int], regen: Regeneration) -> list[list[int]]:
    """The decode loop both engines share. `step(tokens, rows)` runs the engine and returns
    next-token logits [len(rows), V]: tokens None = prefill every prompt (rows = all of them), else
    feed tokens[k] to request rows[k]. `rows` holds the requests still decoding, in the order of the
    previous step's rows: the engine drops the others from its batch, so a finished request takes
    no more KV slots (`kv_slots`) and never grows past its prompt + budget. A request stops at a
    stop id (kept as its last token) or after its budget of new tokens."""
    generators = [request_generator(regen.seed, p) for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))
    logits = step(None, rows)
    keep = [k for k, b in enumerate(rows) if budgets[b] > 0]  # a request without a budget is only prefilled
    rows, logits = [rows[k] for k in keep], logits[keep]
    while rows:
        tokens = sample_next(logits, regen.temperature, regen.top_p, [generators[b] for b in rows])
        for b, t in zip(rows, tokens.tolist()):
            answers[b].append(t)
        keep = [k for k, b in enumerate(rows) if answers[b][-1] not in regen.stop_ids and len(answers[b]) < budgets[b]]
        rows = [rows[k] for k in keep]
        if rows:
            logits = step(tokens[keep], rows)
    return answers
