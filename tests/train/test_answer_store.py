"""The regenerated answers' token ids on disk (train/answer_store.py): whole records round-trip,
a record torn by a crash is dropped and cut off before the next append, a damaged file or one of
other settings is refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from specforge_k25.train.answer_store import FILE, AnswerStore, known_conversations, prompt_key, read_store

PROVENANCE = {"target_digest": "abc", "temperature": 0.0, "max_new_tokens": 4, "stop_ids": [0]}


def _store(tmp_path, pairs):
    store = AnswerStore(tmp_path, PROVENANCE, write=True)
    store.append([(torch.tensor(p), torch.tensor(a)) for p, a in pairs])
    return store


def test_answers_round_trip_once_per_prompt(tmp_path):
    _store(tmp_path, [([5, 6, 7], [8, 0]), ([9], [])])
    again = AnswerStore(tmp_path, PROVENANCE, write=True)
    loaded = {key: (n, answer.tolist()) for key, (n, answer) in again.load().items()}
    assert loaded == {prompt_key(torch.tensor([5, 6, 7])): (3, [8, 0]), prompt_key(torch.tensor([9])): (1, [])}
    again.append([(torch.tensor([5, 6, 7]), torch.tensor([8, 0])), (torch.tensor([1, 2]), torch.tensor([3]))])
    lines = (tmp_path / FILE).read_text().splitlines()
    assert len(lines) == 1 + 3  # the header, then each prompt once
    known = known_conversations(again.load(), {4: torch.tensor([5, 6, 7]), 5: torch.tensor([4])}, lambda p: 4, tmp_path)
    assert list(known) == [4] and known[4].tolist() == [5, 6, 7, 8, 0]
    with pytest.raises(ValueError, match="room for 1"):  # a saved answer longer than this run allows
        known_conversations(again.load(), {0: torch.tensor([5, 6, 7])}, lambda p: 1, tmp_path)


def test_a_torn_last_record_is_dropped_and_cut_before_the_next_append(tmp_path):
    _store(tmp_path, [([5, 6, 7], [8, 0]), ([9], [3, 3])])
    path = tmp_path / FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # the crash cut the last record short
    resumed = AnswerStore(tmp_path, PROVENANCE, write=True)
    assert list(resumed.load()) == [prompt_key(torch.tensor([5, 6, 7]))]
    resumed.append([(torch.tensor([9]), torch.tensor([3, 3]))])  # decoded again, appended whole
    assert path.read_bytes() == whole
    # a last line whose newline was written but whose CRC does not match is a torn record too
    record = json.loads(whole.splitlines()[-1])
    record["answer"] = [3]
    path.write_bytes(whole[:whole.rstrip(b"\n").rfind(b"\n") + 1] + json.dumps(record).encode() + b"\n")
    assert len(read_store(path, PROVENANCE)[0]) == 1


def test_damaged_or_foreign_files_are_refused(tmp_path):
    _store(tmp_path, [([5, 6, 7], [8, 0]), ([9], [3, 3])])
    path = tmp_path / FILE
    header, first, second = path.read_text().splitlines()
    path.write_text("\n".join([header, first.replace('"crc":', '"crc":1'), second]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a whole answer record"):
        read_store(path, PROVENANCE)
    with pytest.raises(ValueError, match=r"max_new_tokens: saved 4 vs this run 8"):
        read_store(path, {**PROVENANCE, "max_new_tokens": 8})
    with pytest.raises(FileNotFoundError, match="no saved answers there"):
        read_store(tmp_path / "missing.jsonl", PROVENANCE)
    path.write_text(header[:10])
    with pytest.raises(ValueError, match="not a file of regenerated answer ids"):
        read_store(path, PROVENANCE)
    path.write_text("")
    with pytest.raises(ValueError, match="empty, not a file of regenerated answer ids"):
        read_store(path, PROVENANCE)
