"""A regenerating run's bookkeeping of the target's answers (`RegenerationBook`): the readable log
`<run>/regenerated.jsonl` (one line per sample, appended as they arrive; a resumed run appends the
re-run items again, identical under the fixed seed), a wandb table of the first ones, counts by
status, and the answers' token ids (train/answer_store.py) saved as they come and read back so that
no prompt is decoded twice."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..data.regenerate import SKIPPED, regeneration_prompt
from .answer_store import AnswerStore, known_conversations, read_store, store_path

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


class RegenerationBook:
    """What a regenerating run keeps of the target's answers, on every rank (rank 0 writes).
    `provenance`: train/answer_store.py `answer_provenance` of the run (what decided the answers)."""

    def __init__(self, run_dir: Path, tokenizer, samples, budget, provenance: dict, ranks, regen_source: str | None):
        self.samples, self.budget, self.ranks, self.regen_source = samples, budget, ranks, regen_source
        self.log = RegenerationLog(Path(run_dir) / "regenerated.jsonl", tokenizer, write=ranks.main)
        self.answers = AnswerStore(run_dir, provenance, write=ranks.main)
        self.run_dir = Path(run_dir)

    def item_tokens(self, kind: str, batch, share: list[int], regenerated) -> int:
        """Tokens of a whole schedule item, which only the target knew: this rank's batch gathered
        with every rank's answers (a collective every rank makes per item), which are counted,
        logged and saved."""
        local = (batch.num_tokens if batch is not None else 0, self.log.rows_of(kind, share, regenerated or []),
                 [(i, sample.input_ids) for i, (sample, _) in zip(share, regenerated or [])])
        gathered = self.ranks.gather(local)
        self.log.add([row for _, rows, _ in gathered for row in rows])
        prompts = [(regeneration_prompt(self.samples[i]), ids) for _, _, pairs in gathered for i, ids in pairs]
        self.answers.append([(prompt, ids[len(prompt):]) for prompt, ids in prompts])
        return sum(tokens for tokens, _, _ in gathered)

    def saved_answers(self, used: set[int]) -> dict[int, torch.Tensor]:
        """{sample: prompt + answer} of the samples in `used` (this rank's replica's) with an answer
        saved by this run (before a resume) or in data.regen_source; rank 0 reads the files, before
        any target starts (a file of other settings is refused here)."""
        answers = {}
        if self.ranks.main:
            if self.regen_source:
                answers.update(read_store(store_path(self.regen_source), self.answers.provenance)[0])
            answers.update(self.answers.load())
        answers = self.ranks.from_main(answers)
        prompts = {i: regeneration_prompt(self.samples[i]) for i in used}
        known = known_conversations(answers, prompts, self.budget, store_path(self.regen_source or self.run_dir))
        if self.ranks.main and known:
            print(f"regeneration: {len(known)} of {len(used)} samples to run have a saved answer (not decoded again)"
                  + (f", {len(used) - len(known)} to decode" if len(used) > len(known) else ""), flush=True)
        return known

    @property
    def written_bytes(self) -> int:
        """Bytes of answer ids this rank wrote (kept apart from the trainer's other writes)."""
        return self.answers.written_bytes
