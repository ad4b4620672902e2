"""Build the tokenized train / held-out splits from a configured source, counting skips."""
from __future__ import annotations

import copy
import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from .sources import BadRow, iter_source, normalize_row
from .tokenize import Sample, tokenize_conversation


@dataclass
class TokenizedData:
    train: list[Sample]
    heldout: list[Sample]
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    truncated: int = 0  # rows cut to max_length (still used)
    rows_seen: int = 0
    turns_dropped: int = 0  # rows over max_length kept as a suffix of their whole turns (earlier turns left out)

    def train_sha1(self) -> str:
        """The resume fingerprint's hash of the training split, as checkpoints have always recorded
        it (token ids and loss masks, in order)."""
        return _split_sha1(self.train)

    def heldout_sha1(self) -> str:
        """The same hash of the held-out split: a resume's restored evaluations are of these samples."""
        return _split_sha1(self.heldout)

    def sha1(self) -> str:
        """A hash of everything prepared (both splits; each sample's length, token ids and loss
        mask, in order): what the trainer ranks compare, each having prepared its own copy."""
        digest = hashlib.sha1()
        for split in (self.train, self.heldout):
            digest.update(len(split).to_bytes(8, "little"))
            for s in split:
                digest.update(len(s.input_ids).to_bytes(8, "little"))
                digest.update(s.input_ids.numpy().tobytes())
                digest.update(s.loss_mask.numpy().tobytes())
        return digest.hexdigest()

    def summary(self) -> dict:
        return {
            "rows_seen": self.rows_seen,
            "train_samples": len(self.train),
            "heldout_samples": len(self.heldout),
            "train_tokens": sum(len(s.input_ids) for s in self.train),
            "train_loss_tokens": int(sum(int(s.loss_mask.sum()) for s in self.train)),
            "truncated_rows": self.truncated,
            "rows_kept_as_later_turns": self.turns_dropped,
            "skipped": dict(self.skipped),
        }


def _trainable(sample: Sample) -> int:
    return int(sample.loss_mask[2:].sum())  # as make_sample: positions from 2 train


def fit_turns(render, messages: list[dict], max_length: int) -> tuple[Sample, bool]:
    """`render(messages, max_length)` -> Sample, for a conversation longer than max_length the one
    that trains the most tokens, and whether earlier turns were left out. Candidates: the whole
    conversation and every suffix of it that starts at a user turn (leading system messages kept),
    each rendered as the server renders that conversation (a template's default system prompt
    and the row's `tools` included) and cut at max_length; ties go to the longer context. A cut
    alone drops a row whose first prompt fills max_length, and cuts a long early answer where a
    later exchange would train more. Raises the whole row's BadRow when no candidate keeps a
    trainable token."""
    try:
        best, best_start = render(messages, max_length), 0
    except BadRow as bad:
        if bad.reason != "no_loss_tokens_after_truncation":
            raise
        best, best_start, whole = None, 0, bad
    if best is not None and not best.truncated:
        return best, False
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    first_user = next((i for i in range(lead, len(messages)) if messages[i]["role"] == "user"), len(messages))
    for j in (j for j in range(first_user + 1, len(messages)) if messages[j]["role"] == "user"):
        # a copy, not a slice: a slice of a `Conversation` is a plain list without the row's
        # `tools`, and a suffix rendered without its tool_declare turn is not what the server
        # renders for it (a declaration that cannot fit then fails every candidate: BadRow)
        candidate = copy.copy(messages)
        del candidate[lead:j]
        try:
            sample = render(candidate, max_length)
        except BadRow:
            continue
        if best is None or _trainable(sample) > _trainable(best):
            best, best_start = sample, j
        if not sample.truncated:  # every later suffix holds a subset of these turns
            break
    if best is None:
        raise whole
    return best, best_start > 0


def build_dataset(
    tokenizer,
    *,
    source: str,
    path: str | None,
    max_length: int,
    num_samples: int,
    heldout_samples: int,
    end_of_turn_id: int,
    seed: int = 0,
    max_rows_scanned: int | None = None,
    split: str = "train",
    show_progress: bool = True,
    render=None,
    fit_long_rows: bool = True,
) -> TokenizedData:
    """Read rows until `num_samples + heldout_samples` good samples exist (or the source ends).

    The held-out split is taken from a seeded shuffle of the good samples, so it never
    overlaps the training split.

    `render`: optional `(messages, max_length) -> Sample` raising `BadRow`, used instead of
    the chat-template path (`tokenize_conversation`), e.g. `kimi_format.kimi_renderer(...)`.
    `fit_long_rows`: a row over max_length becomes its best suffix of whole turns (`fit_turns`);
    false: it is cut at max_length only.
    """
    agentic = render is not None
    if render is None:
        def render(messages, length):
            return tokenize_conversation(tokenizer, messages, length, end_of_turn_id)
    want = num_samples + heldout_samples
    samples: list[Sample] = []
    skipped: Counter = Counter()
    truncated = rows = turns_dropped = 0
    bar = tqdm(total=want, desc="tokenize", unit="sample", disable=not show_progress)
    for row in iter_source(source, path, split):
        if len(samples) >= want or (max_rows_scanned and rows >= max_rows_scanned):
            break
        rows += 1
        try:
            messages = normalize_row(row, agentic=agentic)
            sample, dropped = (fit_turns(render, messages, max_length) if fit_long_rows
                               else (render(messages, max_length), False))
        except BadRow as bad:
            skipped[bad.reason] += 1
            continue
        except Exception as err:  # a tokenizer/template failure on one row must not end the run
            skipped[f"render_error:{type(err).__name__}"] += 1
            continue
        truncated += sample.truncated
        turns_dropped += dropped
        samples.append(sample)
        bar.update(1)
    bar.close()
    if len(samples) < 2:
        raise ValueError(f"only {len(samples)} usable samples from data.source={source} (skipped: {dict(skipped)})")
    random.Random(seed).shuffle(samples)
    n_held = min(heldout_samples, len(samples) // 5) if len(samples) < want else heldout_samples
    if heldout_samples and not n_held:  # a run asked to evaluate must not end without its held-out rows
        raise ValueError(f"only {len(samples)} usable samples from data.source={source} (skipped: {dict(skipped)}): "
                         f"a short source gives the held-out split a fifth of them, here none of the "
                         f"data.heldout_samples={heldout_samples}; add rows, or set data.heldout_samples=0 to train "
                         f"on all {len(samples)} without a held-out evaluation")
    return TokenizedData(samples[n_held:], samples[:n_held], skipped, truncated, rows, turns_dropped)


def _split_sha1(samples: list[Sample]) -> str:
    digest = hashlib.sha1()
    for s in samples:
        digest.update(s.input_ids.numpy().tobytes())
        digest.update(s.loss_mask.numpy().tobytes())
    return digest.hexdigest()
