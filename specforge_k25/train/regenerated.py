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
    def __init__(self, path: Path, tokenizer, enabled: bool):
        self.path, self.tokenizer, self.enabled = Path(path), tokenizer, enabled
        self.counts: Counter = Counter()
        self.answer_tokens = 0
        self.rows: list[list] = []

    def add(self, kind: str, sample_ids: list[int], regenerated) -> None:
        """regenerated: [(Sample, status)] of one batch, in the order of `sample_ids`."""
        lines = []
        for sample_id, (sample, status) in zip(sample_ids, regenerated):
            self.counts[status] += 1
            answer = int(sample.loss_mask.sum())
            self.answer_tokens += answer
            if not self.enabled:
                continue
            prompt_len = len(sample.input_ids) - answer if status not in SKIPPED else len(sample.input_ids)
            row = [kind, sample_id, status, answer, self._text(sample.input_ids[:prompt_len]),
                   self._text(sample.input_ids[prompt_len:])]
            lines.append(json.dumps(dict(zip(COLUMNS, row)), ensure_ascii=False))
            if len(self.rows) < TABLE_ROWS:
                self.rows.append(row)
        if lines:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")

    def _text(self, ids) -> str:
        return self.tokenizer.decode(ids.tolist()) if self.tokenizer is not None else " ".join(map(str, ids.tolist()))

    def summary(self) -> dict:
        """Counts of this rank's samples by status, and the answer tokens the loss covered."""
        return {**dict(self.counts), "answer_tokens_in_loss": self.answer_tokens,
                "skipped": sum(self.counts[s] for s in SKIPPED)}
