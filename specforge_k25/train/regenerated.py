"""The target's regenerated answers, readable without any hidden state: `<run>/regenerated.jsonl`
(one line per sample, appended as they arrive; a resumed run appends the re-run items again,
identical under the fixed seed), a wandb table of the first ones, and counts by status."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ..data.regenerate import SKIPPED

TABLE_ROWS = 32
COLUMNS = ["kind", "sample", "status", "answer_tokens", "prompt", "answer"]


class RegenerationLog:
    """Every rank turns its share of a batch into rows (`rows_of`); the rows of all ranks, gathered,
    go through `add` on every rank, so the counts are the run's (not one rank's) and rank 0
    (`write`) appends every sample to the JSONL."""

    def __init__(self, path: Path, tokenizer, write: bool):
        self.path, self.tokenizer, self.write = Path(path), tokenizer, write
        self.counts: Counter = Counter()
        self.answer_tokens = 0
        self.rows: list[list] = []  # the first TABLE_ROWS, for the wandb table

    def rows_of(self, kind: str, sample_ids: list[int], regenerated) -> list[list]:
        """regenerated: [(Sample, status)] of this rank's share, in the order of `sample_ids`."""
        rows = []
        for sample_id, (sample, status) in zip(sample_ids, regenerated):
            answer = int(sample.loss_mask.sum())
            prompt_len = len(sample.input_ids) - answer if status not in SKIPPED else len(sample.input_ids)
            rows.append([kind, sample_id, status, answer, self._text(sample.input_ids[:prompt_len]),
                         self._text(sample.input_ids[prompt_len:])])
        return rows

    def add(self, rows: list[list]) -> None:
        """Count the rows of one schedule item (every rank's share) and, on the writing rank, append them."""
        for row in rows:
            self.counts[row[2]] += 1
            self.answer_tokens += row[3]
        if not (self.write and rows):
            return
        self.rows.extend(rows[:max(0, TABLE_ROWS - len(self.rows))])
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("\n".join(json.dumps(dict(zip(COLUMNS, row)), ensure_ascii=False) for row in rows) + "\n")

    def _text(self, ids) -> str:
        return self.tokenizer.decode(ids.tolist()) if self.tokenizer is not None else " ".join(map(str, ids.tolist()))

    def summary(self) -> dict:
        """Counts of the run's samples by status, and the answer tokens the loss covered."""
        return {**dict(self.counts), "answer_tokens_in_loss": self.answer_tokens,
                "skipped": sum(self.counts[s] for s in SKIPPED)}
