"""The target's regenerated answers as token ids, `<run>/regenerated_ids.jsonl`: what lets every
prompt be decoded once, and a later run train on an earlier run's answers (data.regen_source).

Token ids and prompt lengths only (no hidden state); the loss mask and status are rebuilt from
them by the run's own rules (data/regenerate.py). Re-tokenizing the decoded text of
regenerated.jsonl would not give the generated ids back, hence this file.

Format (JSON Lines, one object a line):
- line 1, the header: {"format": FORMAT, "version": 1, "provenance": {...}}: what decided the
  answers (the target and its weights, dtype, chat format, the served sampling settings, seed,
  max_length, the answer budget and stop ids). A run uses a file only when its own provenance is
  equal (`check_provenance`); anything else is refused by name before the target starts.
- then one record per answer: {"prompt_sha1", "prompt_length", "answer": [ids], "crc"}: the key is
  the sha1 of the prompt's ids (the rendered conversation up to the answer), so a later run finds
  an answer by its prompt whatever its split or order; `crc` is the CRC-32 of the answer's ids.

Appends survive a crash: each record is one line, flushed and fsync'ed as it is written; a last
line without its newline, not JSON or with a wrong CRC is a torn write, dropped (and cut off before
the next append). Such a line anywhere else is a damaged file: refused, naming the line.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import torch

FILE = "regenerated_ids.jsonl"
FORMAT = "specforge_k25 regenerated ids"
VERSION = 1
PAGE = 4096


def prompt_key(prompt: torch.Tensor) -> str:
    return hashlib.sha1(prompt.to(torch.int64).numpy().tobytes()).hexdigest()


def _crc(answer: list[int]) -> int:
    return zlib.crc32(json.dumps(answer, separators=(",", ":")).encode())


def store_path(source: str | Path) -> Path:
    """A run folder (its regenerated_ids.jsonl) or the file itself."""
    path = Path(source)
    return path / FILE if path.is_dir() else path


SOURCE_HINT = "use data.regen_* and target settings as saved, or leave data.regen_source unset to decode every prompt"
OWN_HINT = "this run folder holds answers of other settings: choose another train.out_dir, or remove the file"


def check_provenance(saved: dict, current: dict, where: Path, hint: str = SOURCE_HINT) -> None:
    """Refuse answers decoded under other settings, listing every difference."""
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: saved {saved.get(k, '<absent>')!r} vs this run {current.get(k, '<absent>')!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"{where}: its answers were decoded under other settings than this run's; training on "
                         f"them would not be training on this run's target answers:\n  " + "\n  ".join(diffs)
                         + f"\n({hint})")


def read_store(path: Path, provenance: dict, hint: str = SOURCE_HINT) -> tuple[dict[str, tuple[int, torch.Tensor]], int]:
    """{prompt sha1: (prompt length, answer ids [A] int32)} of a store whose provenance equals `provenance`,
    and the byte length of its whole records (a torn last line lies beyond it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved answers there (data.regen_source names a run folder holding "
                                f"{FILE} or that file itself)")
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn_tail = lines[-1] != b""  # the last line ended without its newline: a torn write, or nothing after the last \n
    lines = lines[:-1] if not torn_tail else lines
    if not lines:
        raise ValueError(f"{path}: empty, not a file of regenerated answer ids (no header line)")
    answers: dict[str, tuple[int, torch.Tensor]] = {}
    good_bytes = 0
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        record = _parse(line)
        if n == 1:
            if not (isinstance(record, dict) and record.get("format") == FORMAT):
                raise ValueError(f"{path}: not a file of regenerated answer ids (line 1 is not its header "
                                 f"{{\"format\": {FORMAT!r}, ...}})")
            if record.get("version") != VERSION:
                raise ValueError(f"{path}: version {record.get('version')!r}, this trainer reads version {VERSION}")
            if last and torn_tail:
                raise ValueError(f"{path}: its header line is cut short")
            check_provenance(record.get("provenance") or {}, provenance, path, hint)
        else:
            entry = _answer(record)
            if entry is None or (last and torn_tail):
                if last:  # a write cut short by a crash: dropped, the prompt is decoded again
                    break
                raise ValueError(f"{path}: line {n} is not a whole answer record (a damaged file; the records "
                                 f"before it are fine: remove line {n} on, to decode those prompts again)")
            answers[entry[0]] = (entry[1], torch.tensor(entry[2], dtype=torch.int32))  # 4 bytes a token held
        good_bytes += len(line) + 1
    return answers, good_bytes


def _parse(line: bytes):
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None


def _answer(record) -> tuple[str, int, list[int]] | None:
    if not isinstance(record, dict):
        return None
    key, length, answer = record.get("prompt_sha1"), record.get("prompt_length"), record.get("answer")
    if not (isinstance(key, str) and isinstance(length, int) and length >= 0 and isinstance(answer, list)
            and all(isinstance(t, int) and t >= 0 for t in answer) and record.get("crc") == _crc(answer)):
        return None
    return key, length, answer


class AnswerStore:
    """The run's own regenerated_ids.jsonl: read on a resume, appended by the writing rank (rank 0)."""

    def __init__(self, run_dir: Path, provenance: dict, write: bool):
        self.path, self.provenance, self.write = Path(run_dir) / FILE, provenance, write
        self.saved: set[str] = set()
        self._opened = False
        # what the appends cost the disk: each fsync writes the pages it touched (the last one again)
        self.written_bytes = 0

    def load(self) -> dict[str, tuple[int, torch.Tensor]]:
        """The answers this run saved already (none when it has no file yet)."""
        if not self.path.exists():
            return {}
        answers, _ = read_store(self.path, self.provenance, OWN_HINT)
        self.saved = set(answers)
        return answers

    def append(self, records: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(prompt, answer) id pairs; a prompt saved already is skipped."""
        if not self.write:
            return
        lines = []
        for prompt, answer in records:
            key = prompt_key(prompt)
            if key in self.saved:
                continue
            self.saved.add(key)
            ids = [int(t) for t in answer]
            lines.append(json.dumps({"prompt_sha1": key, "prompt_length": len(prompt), "answer": ids, "crc": _crc(ids)},
                                    separators=(",", ":")))
        if not lines:
            return
        self._open()
        text = ("\n".join(lines) + "\n").encode()
        start = self.path.stat().st_size % PAGE
        self.written_bytes += -(-(start + len(text)) // PAGE) * PAGE
        with open(self.path, "ab") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def _open(self) -> None:
        """Before the first append: the header of a new file (written whole, then renamed), or an
        existing file cut back to its whole records (a torn last line dropped)."""
        if self._opened:
            return
        if not self.path.exists():
            tmp = self.path.with_suffix(".tmp")
            header = {"format": FORMAT, "version": VERSION, "provenance": self.provenance}
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(header) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self.written_bytes += -(-self.path.stat().st_size // PAGE) * PAGE
        else:
            _, whole = read_store(self.path, self.provenance, OWN_HINT)
            if self.path.stat().st_size != whole:
                os.truncate(self.path, whole)
        self._opened = True


def known_conversations(answers: dict[str, tuple[int, torch.Tensor]], prompts: dict[int, torch.Tensor], budget,
                        where: Path) -> dict[int, torch.Tensor]:
    """{sample: prompt + saved answer} for the prompts ({sample: prompt ids}) that have one.
    `budget(prompt_len)`: the most new tokens the run allows (a longer saved answer is refused)."""
    known = {}
    for i, prompt in prompts.items():
        found = answers.get(prompt_key(prompt))
        if found is None:
            continue
        length, answer = found
        if length != len(prompt) or len(answer) > budget(len(prompt)):
            raise ValueError(f"{where}: the answer saved for sample {i}'s prompt has prompt length {length} and "
                             f"{len(answer)} tokens, this run's prompt {len(prompt)} tokens with room for "
                             f"{budget(len(prompt))}: not this run's settings")
        known[i] = torch.cat([prompt, answer.to(prompt.dtype)])
    return known


def answer_provenance(job, regen, target_digest: str) -> dict:
    """What decides a run's answers: the target (its weights' digest and dtype), how prompts are
    rendered, and the served sampling settings (data.regen_*, resolved: the budget and stop ids)."""
    return {"target_digest": target_digest, "target_dtype": job.hw.target_dtype,
            "chat_format": job.target.chat_format, "chat_mode": job.target.chat_mode,
            "max_length": regen.max_length, "max_new_tokens": regen.max_new_tokens,
            "temperature": regen.temperature, "top_p": regen.top_p, "seed": regen.seed,
            "stop_ids": list(regen.stop_ids)}
