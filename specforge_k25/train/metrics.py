"""Metric names, aggregation of TTT statistics, and the wandb / no-op logger behind one interface.

Metric glossary (also the wandb panel names). k counts the draft method's depth (DraftMethod.depth,
its loss's LossResult counters: e.g. EAGLE-3's TTT steps, DFlash's block positions 1.. as k = 0..);
what is predicted and against what is the method's own (its loss's docstring).
  train/loss        the method's loss of the last micro-batch (its weighting of the ploss_k)
  train/ploss_k     the loss at depth k (mean over its counted positions)
  train/acc_k       fraction of supervised positions where the draft's top-1 at depth k is right
  eval/acc_k        the same on the held-out split;  eval/alpha_k  the mean of Σ_v min(p_ref, q_draft)
                    at depth k (the reference: the target's distribution, or the method's one-hot label)
  eval/tau_sim      1 + Σ_k Π_{j<=k} acc_j: simulated acceptance length of k drafts per verify step,
                    each depth's accuracy given the true prefix
  perf/tokens_per_s trained tokens (prompt + answer) per second, wall clock
  stream/depth      target batches waiting for the trainer (0 = trainer-bound is good: target waits)
  stream/wait_frac  fraction of trainer wall time spent waiting for the target
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..draft.objective import LossResult, simulated_acceptance_length


class LossStats:
    """Sums of TTT counters over batches -> acc_k, alpha_k, ploss_k, tau_sim."""

    def __init__(self):
        self.correct = self.scored = self.alpha = self.ploss_weighted = self.counted = None

    def add(self, res: LossResult) -> None:
        vals = [res.correct.double(), res.scored.double(), res.alpha_sum.double(),
                (res.ploss * res.counted).double(), res.counted.double()]
        if self.correct is None:
            self.correct, self.scored, self.alpha, self.ploss_weighted, self.counted = vals
        else:
            for name, v in zip(("correct", "scored", "alpha", "ploss_weighted", "counted"), vals):
                setattr(self, name, getattr(self, name) + v)

    def all_reduce(self, ranks, depth: int, device) -> None:
        """In place: sum the counters over data-parallel ranks (a rank that added nothing sends zeros
        of the method's `depth`)."""
        names = ("correct", "scored", "alpha", "ploss_weighted", "counted")
        zeros = torch.zeros(depth, dtype=torch.float64, device=device)
        packed = torch.stack([zeros if getattr(self, n) is None else getattr(self, n) for n in names])  # [5, K]
        ranks.sum(packed)
        for name, row in zip(names, packed):
            setattr(self, name, row)

    def summary(self, prefix: str) -> dict[str, float]:
        if self.correct is None:
            return {}
        acc = (self.correct / self.scored.clamp(min=1)).tolist()
        alpha = (self.alpha / self.scored.clamp(min=1)).tolist()
        ploss = (self.ploss_weighted / self.counted.clamp(min=1)).tolist()
        out = {f"{prefix}/acc_{k}": a for k, a in enumerate(acc)}
        out.update({f"{prefix}/alpha_{k}": a for k, a in enumerate(alpha)})
        out.update({f"{prefix}/ploss_{k}": p for k, p in enumerate(ploss)})
        out[f"{prefix}/tau_sim"] = simulated_acceptance_length(acc)
        out[f"{prefix}/positions"] = float(self.scored[0])
        return out


class MetricsLogger:
    """wandb (or nothing) plus, always, `<run_dir>/metrics.jsonl`: one JSON line per log call,
    appended and flushed, so a killed run keeps its history and a resumed run continues it."""

    def __init__(self, kind: str, *, project: str, mode: str, run_dir: str, config: dict):
        self.run = None
        self._jsonl = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")
        if kind == "wandb":
            import wandb

            self.run = wandb.init(project=project, mode=mode, dir=run_dir, config=config,
                                  settings=wandb.Settings(console="off", silent=True))
            self.run.define_metric("optimizer_step")
            self.run.define_metric("*", step_metric="optimizer_step")
        elif kind != "none":
            raise ValueError(f"train.logger={kind!r}: expected wandb or none")

    def log(self, metrics: dict, step: int) -> None:
        self._jsonl.write(json.dumps({"optimizer_step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log({**metrics, "optimizer_step": step})

    def summary(self, values: dict) -> None:
        if self.run is not None:
            for k, v in values.items():
                if isinstance(v, (int, float, str)):
                    self.run.summary[k] = v

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A wandb table (e.g. regenerated answers to read); nothing without wandb."""
        if self.run is not None and rows:
            import wandb

            self.run.log({name: wandb.Table(columns=columns, data=rows)})

    def close(self) -> None:
        self._jsonl.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


class NullLogger:
    """What data-parallel ranks other than 0 log to: nothing."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def summary(self, values: dict) -> None:
        pass

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def close(self) -> None:
        pass
