"""Predicted decode throughput with and without speculation, per serving setting, concurrency and
context (serving/cost.py prices the steps), and the best setting per concurrency.

A setting drafts `drafted` tokens a step; with per-position acceptance a_1.. (a_i = P(drafted
token i accepted | tokens 1..i-1 were)), a verify step yields AL = 1 + a_1 + a_1 a_2 + ... tokens
per request (the 1: the target's own next token). Throughput = concurrency x AL / (verify step +
draft work); without speculation concurrency / decode step. Speedup = their ratio.
Positions past the measured ones repeat the last measured rate (said in the output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..plan.facts import TargetFacts
from .cost import DraftShape, Node, ServingError, check_finite, draft_cost, target_step

Routing = Callable[[int, int], float]  # (tokens per request, concurrency) -> distinct experts summed over MoE layers


NGRAM = "ngram"  # prompt lookup: the reference without a head, drafted on the host


@dataclass(frozen=True)
class Setting:
    """One way to serve a head: a draft method (or ngram) and the tokens it drafts a verify step,
    with the draft work the method's own serving arguments imply (DraftMethod.servings)."""

    method: str
    drafted: int
    label: str
    forwards: int = 0  # draft forwards per verify step (SGLang's speculative_num_steps)
    tokens_per_forward: int = 0  # per request: 1 in a chain; the whole block when one forward drafts them all
    extend: bool = False  # a chain drafter's draft extend: one more forward over the verify step's tokens


def settings_for(method: str, depths: list[int]) -> list[Setting]:
    """The settings of `method` drafting each of `depths` tokens a step, as its servings at the
    chain [d, 1, d + 1] give them: a chain drafter runs d forwards of one token (then its draft
    extend), a block drafter one forward of its d + 1 block (one serving per distinct block)."""
    from ..draft.registry import get_method

    if not depths or min(depths) < 1:
        raise ServingError(f"serving.depths={depths}: drafted tokens per step must be >= 1")
    if method == NGRAM:
        return [Setting(NGRAM, d, f"ngram {d}") for d in sorted(set(depths))]
    try:
        served = get_method(method)
    except ValueError as err:
        raise ServingError(f"serving.method={method!r}: {err} (or {NGRAM})") from err
    if not getattr(served, "sglang_algorithm", ""):
        raise ServingError(f"serving.method={method!r}: SGLang does not serve this method's exports")
    out = []
    for d in sorted(set(depths)):
        s = served.servings([[d, 1, d + 1]])[0]
        steps = int(s.sglang_args.get("speculative_num_steps", s.depth))
        block = steps == 1 and s.depth > 1
        out.append(Setting(method, s.depth, f"{method} {s.label}", steps, s.draft_tokens if block else 1, not block))
    return out


def acceptance_length(acceptance: list[float], drafted: int) -> float:
    """AL = 1 + sum_j prod_{i<=j} a_i over `drafted` positions (the last rate repeated past the list)."""
    check_acceptance(acceptance)
    al, run = 1.0, 1.0
    for j in range(drafted):
        run *= acceptance[min(j, len(acceptance) - 1)]
        al += run
    return al


def check_acceptance(acceptance: list[float]) -> None:
    if not acceptance:
        raise ServingError("no per-position acceptance: give serving.acceptance=[a_1,...] or serving.run=<run folder>")
    bad = [a for a in acceptance if not 0.0 <= float(a) <= 1.0]
    if bad:
        raise ServingError(f"serving.acceptance: rates must lie in [0, 1], got {bad}")


def per_position_from_ratio(ratio: float, drafted: int) -> list[float]:
    """The constant per-position rate a with a + a^2 + ... + a^drafted = ratio x drafted: what an
    'accepted / drafted' figure (the users' n-gram 17-31 % of 5) means per position."""
    if not 0.0 <= ratio <= 1.0:
        raise ServingError(f"accepted/drafted ratio {ratio} outside [0, 1]")
    target, lo, hi = ratio * drafted, 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, drafted + 1)) < target:
            lo = mid
        else:
            hi = mid
    return [lo] * drafted


@dataclass
class Prediction:
    concurrency: int
    context: int
    setting: str
    drafted: int
    acceptance_length: float
    decode_s: float  # one decode step (no speculation)
    verify_s: float  # one verify step
    draft_s: float  # the draft's work per verify step
    allreduce_share: float  # of the decode step
    speedup: float

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency * self.acceptance_length / (self.verify_s + self.draft_s)

    @property
    def baseline_tokens_per_s(self) -> float:
        return self.concurrency / self.decode_s

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency, "context": self.context, "setting": self.setting,
                "drafted": self.drafted, "acceptance_length": round(self.acceptance_length, 4),
                "speedup": round(self.speedup, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "baseline_tokens_per_s": round(self.baseline_tokens_per_s, 2),
                "decode_step_ms": round(self.decode_s * 1e3, 4), "verify_step_ms": round(self.verify_s * 1e3, 4),
                "draft_ms": round(self.draft_s * 1e3, 4), "decode_allreduce_share": round(self.allreduce_share, 4)}


def predict_one(facts: TargetFacts, node: Node, routing: Routing, setting: Setting, shape: DraftShape | None,
                acceptance: list[float], concurrency: int, context: int) -> Prediction:
    decode = target_step(facts, node, concurrency, 1, context, routing(1, concurrency))
    verify = target_step(facts, node, concurrency, setting.drafted + 1, context, routing(setting.drafted + 1, concurrency))
    draft = draft_cost(setting, shape, node, concurrency, context)
    al = acceptance_length(acceptance, setting.drafted)
    check_finite(decode.total, verify.total, draft.total)
    return Prediction(concurrency, context, setting.label, setting.drafted, al, decode.total, verify.total, draft.total,
                      decode.allreduce_s / decode.total, al * decode.total / (verify.total + draft.total))


def predict_all(facts: TargetFacts, node: Node, routing: Routing, settings: list[Setting], shape: DraftShape | None,
                acceptance: list[float], concurrencies: list[int], contexts: list[int]) -> list[Prediction]:
    if not concurrencies or min(concurrencies) < 1 or not contexts or min(contexts) < 1:
        raise ServingError(f"serving.concurrency={concurrencies} and serving.context={contexts} must be non-empty, >= 1")
    return [predict_one(facts, node, routing, s, shape, acceptance, c, ctx)
            for ctx in contexts for c in concurrencies for s in settings]


def best_per_concurrency(predictions: list[Prediction], context: int) -> dict[int, Prediction | None]:
    """Per concurrency at `context`, the fastest setting; None ('off') where none beats no speculation."""
    best: dict[int, Prediction | None] = {}
    for p in predictions:
        if p.context != context:
            continue
        cur = best.get(p.concurrency)
        if p.speedup > 1.0 and (cur is None or p.speedup > cur.speedup):
            best[p.concurrency] = p
        else:
            best.setdefault(p.concurrency, None)
    return dict(sorted(best.items()))
