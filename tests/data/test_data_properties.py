"""Property tests (hypothesis) over the data loader: JSONL source -> normalize_row ->
tokenize_conversation -> build_dataset.

Generated rows mix good and bad turns (unknown roles, non-string content, empty/blank turns,
lone surrogates / U+FFFD, rows without an assistant turn, rows ending on a user turn), raw JSONL
lines that are sometimes not JSON (or not valid UTF-8), and max_length values small enough to
truncate most rows. Every row must be skipped (counted by reason) or become a sample with a
correct loss mask; nothing else may escape.

The loss-mask oracle is independent of `tokenize_conversation`: it scans the token sequence
for `<|im_start|>` + role-header tokens and `<|im_end|>` and marks the content of assistant
turns plus the `<|im_end|>` that closes them.

Uses the real SmolLM2-135M-Instruct tokenizer (ChatML), loaded once per module (hypothesis
does not mix with function-scoped fixtures).
"""
from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specforge_k25.data.dataset import build_dataset
from specforge_k25.data.sources import ROLE_ALIASES, BadRow, iter_jsonl, normalize_row
from specforge_k25.data.tokenize import Sample, tokenize_conversation

# ----------------------------------------------------------------------------------------------
# Tokenizer (module-level cache) and the token-level oracle
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _tok():
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.models import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


@lru_cache(maxsize=1)
def _ids_info():
    tok = _tok()
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end == tok.eos_token_id
    headers = {}
    for role in ("system", "user", "assistant"):
        h = tok.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
        assert h[0] == im_start
        headers[role] = h[1:]  # role tokens + newline, after <|im_start|>
    return im_start, im_end, headers


def _eot() -> int:
    return _ids_info()[1]


def _oracle_mask(ids: list[int]) -> list[bool]:
    """Independent loss mask from the tokens alone.

    Each turn is `<|im_start|>` + header (`role\\n`) + content + `<|im_end|>`; a truncated
    sequence may end inside one. Assistant content and its closing `<|im_end|>` are True,
    everything else (headers, system/user turns, newlines between turns) False. A turn whose
    header tokens are not the plain role header (the header newline merged with the content)
    is never an assistant turn in a valid sample: the implementation must reject those rows.
    """
    im_start, im_end, headers = _ids_info()
    n = len(ids)
    mask = [False] * n
    p = 0
    while p < n:
        if ids[p] != im_start:
            p += 1
            continue
        role = start = None
        for r, h in headers.items():
            if ids[p + 1 : p + 1 + len(h)] == h:
                role, start = r, p + 1 + len(h)
        q = p + 1
        while q < n and ids[q] != im_end:
            q += 1
        if role is None:
            text = _tok().decode(ids[p + 1 : q])
            # an incomplete header at the truncation point is fine; a complete assistant header
            # whose newline merged into the content must never reach a sample
            assert not text.startswith("assistant\n"), f"assistant turn with merged header in a sample: {text!r}"
        elif role == "assistant":
            for t in range(start, q):
                mask[t] = True
            if q < n:
                mask[q] = True
        p = q + 1
    return mask


def _check_sample(sample: Sample, max_length: int) -> None:
    assert isinstance(sample, Sample)
    assert sample.input_ids.dtype == torch.int64 and sample.loss_mask.dtype == torch.bool
    assert sample.input_ids.dim() == 1 and sample.input_ids.shape == sample.loss_mask.shape
    assert 0 < len(sample.input_ids) <= max_length
    assert bool(sample.loss_mask[2:].any())
    ids = sample.input_ids.tolist()
    assert sample.loss_mask.tolist() == _oracle_mask(ids)


# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def _no_specials(s: str) -> bool:
    return not any(sp in s for sp in SPECIALS)


def _clean(s: str) -> bool:
    return "\ufffd" not in s and not any(0xD800 <= ord(c) <= 0xDFFF for c in s)


WORDS = ["Paris", "is", "the", "capital", "of", "France", "hello", "world", "42", "café", "你好",
         "😀", "def", "f(x):", "return", "x", "+", "1", "{", "}", "naïve", "—", "\n", "\t"]

# content that is valid (non-empty after strip, no surrogates / U+FFFD, no special tokens)
good_text = st.one_of(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).map(" ".join),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), min_size=1, max_size=30),
    st.sampled_from(["a", "Rome.", " leading space", "\nnewline first", "trailing\n", "ok"]),
).filter(lambda s: bool(s.strip()) and _no_specials(s) and _clean(s))

any_content = st.one_of(
    good_text,
    good_text,
    st.sampled_from(["", " ", "\n\t ", "bad \ud800 surrogate", "x\udfff", "repl \ufffd"]),
    st.text(st.characters(blacklist_categories=()), max_size=12).filter(_no_specials),  # surrogates too
    st.integers(-5, 5),
    st.none(),
    st.lists(st.just("a"), max_size=2),
)

GOOD_ROLES = ["user", "assistant", "system", "human", "gpt", "Human", "GPT", "chatgpt", "developer", "tool"]
BAD_ROLES = ["bing", 42, None, "", "function"]
any_role = st.one_of(st.sampled_from(GOOD_ROLES), st.sampled_from(GOOD_ROLES), st.sampled_from(BAD_ROLES))


@st.composite
def turns(draw, role=any_role, content=any_content):
    r, c = draw(role), draw(content)
    style = draw(st.sampled_from(["openai", "sharegpt", "openai", "sharegpt", "missing", "not_obj"]))
    if style == "openai":
        return {"role": r, "content": c}
    if style == "sharegpt":
        return {"from": r, "value": c}
    if style == "missing":
        return draw(st.sampled_from([{"content": c}, {"role": r}, {}]))
    return draw(st.sampled_from(["hi", 3, None, ["user", "x"]]))


@st.composite
def any_rows(draw):
    kind = draw(st.sampled_from(["conv", "conv", "conv", "non_object", "no_turns"]))
    if kind == "non_object":
        return draw(st.sampled_from([[], "text", 7, None, [{"role": "user", "content": "x"}]]))
    if kind == "no_turns":
        return draw(st.sampled_from([{}, {"messages": []}, {"conversations": "x"}, {"id": 1}]))
    key = draw(st.sampled_from(["messages", "conversations"]))
    return {key: draw(st.lists(turns(), min_size=1, max_size=6))}


@st.composite
def good_messages(draw, min_turns=1, max_turns=6):
    """Valid normalized conversations: optional system, alternating user/assistant, ends on assistant."""
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(good_text)})
    for _ in range(draw(st.integers(min_turns, max_turns))):
        msgs.append({"role": "user", "content": draw(good_text)})
        msgs.append({"role": "assistant", "content": draw(good_text)})
    return msgs


@st.composite
def good_rows(draw):
    msgs = draw(good_messages(max_turns=3))
    if draw(st.booleans()):
        return {"messages": msgs}
    back = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in msgs]}


@st.composite
def jsonl_lines(draw):
    """One line of bytes (no line break). Mostly JSON rows, sometimes not JSON or not UTF-8."""
    kind = draw(st.sampled_from(["good", "good", "good", "good", "any", "any", "raw"]))
    if kind in ("good", "any"):
        row = draw(good_rows() if kind == "good" else any_rows())
        text = json.dumps(row, ensure_ascii=draw(st.booleans()))
        # ensure_ascii=False + a lone surrogate -> invalid UTF-8 bytes on disk
        return text.encode("utf-8", errors="surrogatepass")
    raw = draw(st.one_of(
        st.sampled_from([b"{not json", b"", b"   ", b"\t", b"\xff\xfe{\"a\"", b"NaN", b"[1, 2]",
                         b"\"s\"", b"{\"messages\": [", b"}", b"null", b"{\"messages\": [{\"role\": \"user\""]),
        st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20)
        .map(lambda s: s.encode("utf-8")),
        good_rows().map(lambda r: json.dumps(r)[: len(json.dumps(r)) // 2].encode()),  # cut short
    ))
    return raw


def _decoded_nonblank(lines: list[bytes]) -> list[str]:
    """The lines iter_jsonl reads (decode with replacement; blank lines are ignored)."""
    out = []
    for b in lines:
        s = b.decode("utf-8", errors="replace")
        if s.strip():
            out.append(s)
    return out


def _json_kind(line: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return "malformed"
    return "object" if isinstance(obj, dict) else "non_object"


NORMALIZE_REASONS = {
    "malformed_json", "not_an_object", "no_turns", "turn_not_an_object", "unknown_role",
    "non_string_content", "non_text_content", "malformed_tool_calls", "empty_turn", "invalid_unicode",
    "no_assistant_turn",
}
KNOWN_REASONS = NORMALIZE_REASONS | {
    "template_not_prefix_stable", "no_end_of_turn_token", "no_loss_tokens_after_truncation",
    "tools_unsupported_by_template",  # SmolLM2's template does not render tool turns
}

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                      HealthCheck.data_too_large])


def test_oracle_sanity():
    """The oracle marks exactly each reply + <|im_end|> and rejects a shifted mask."""
    tok = _tok()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q one"},
            {"role": "assistant", "content": "a one"}, {"role": "user", "content": "q two"},
            {"role": "assistant", "content": "a two"}]
    ids = [int(x) for x in tok.apply_chat_template(msgs, tokenize=True, return_dict=False)]
    mask = _oracle_mask(ids)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "a one<|im_end|>a two<|im_end|>"
    sample = tokenize_conversation(tok, msgs, 4096, _eot())
    assert sample.loss_mask.tolist() == mask
    assert mask[1:] + [False] != mask
    assert _oracle_mask(ids[:-6])[: len(ids) - 6] == mask[: len(ids) - 6]  # cut inside the last reply


# ----------------------------------------------------------------------------------------------
# 1 (+2). build_dataset over generated JSONL
# ----------------------------------------------------------------------------------------------


@settings(max_examples=120, **SETTINGS)
@given(
    lines=st.one_of(st.lists(jsonl_lines(), min_size=4, max_size=16), st.lists(jsonl_lines(), max_size=3)),
    max_length=st.one_of(st.integers(4, 40), st.integers(40, 120), st.integers(120, 400), st.just(4096)),
    num_samples=st.integers(1, 6),
    heldout_samples=st.integers(0, 3),
    max_rows_scanned=st.one_of(st.none(), st.none(), st.integers(1, 16)),
    seed=st.integers(0, 3),
)
def test_build_dataset_never_crashes_and_accounts_every_row(
    lines, max_length, num_samples, heldout_samples, max_rows_scanned, seed
):
    tok = _tok()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.jsonl")
        with open(path, "wb") as fh:
            fh.write(b"\n".join(lines) + (b"\n" if lines else b""))
        try:
            data = build_dataset(
                tok, source="jsonl", path=path, max_length=max_length, num_samples=num_samples,
                heldout_samples=heldout_samples, end_of_turn_id=_eot(), seed=seed,
                max_rows_scanned=max_rows_scanned, show_progress=False,
            )
        except ValueError as err:  # the one documented failure: too few usable samples
            assert str(err).startswith("only ") and "usable samples" in str(err), err
            assert not isinstance(err, BadRow)
            event("outcome: fewer than 2 samples")
            return
    event("outcome: dataset built")
    for reason in data.skipped:
        event(f"skipped: {reason}")
    if data.truncated:
        event("some rows truncated")

    want = num_samples + heldout_samples
    samples = data.train + data.heldout
    assert len(samples) >= 2
    for s in samples:
        _check_sample(s, max_length)
    # held-out and train never share a sample object
    assert not {id(s) for s in data.train} & {id(s) for s in data.heldout}

    # every row read is either a sample or a counted skip, by a known reason
    assert set(data.skipped) <= KNOWN_REASONS, dict(data.skipped)
    assert all(v > 0 for v in data.skipped.values())
    assert data.rows_seen == sum(data.skipped.values()) + len(data.train) + len(data.heldout)

    # reading stops exactly when enough samples exist or the scan limit is hit, never earlier
    read = _decoded_nonblank(lines)
    assert data.rows_seen <= len(read)
    if max_rows_scanned:
        assert data.rows_seen <= max_rows_scanned
    if len(samples) < want and not (max_rows_scanned and data.rows_seen >= max_rows_scanned):
        assert data.rows_seen == len(read)
    assert len(samples) <= want

    # reasons that depend only on the line's JSON are counted exactly
    kinds = [_json_kind(s) for s in read[: data.rows_seen]]
    assert data.skipped.get("malformed_json", 0) == kinds.count("malformed")
    assert data.skipped.get("not_an_object", 0) == kinds.count("non_object")

    # split sizes
    if len(samples) >= want:
        assert len(data.heldout) == heldout_samples and len(data.train) == num_samples
    else:
        assert len(data.heldout) == min(heldout_samples, len(samples) // 5)
    assert len(data.train) >= 1

    summary = data.summary()
    assert summary["rows_seen"] == data.rows_seen
    assert summary["train_samples"] == len(data.train) and summary["heldout_samples"] == len(data.heldout)
    assert summary["train_tokens"] == sum(len(s.input_ids) for s in data.train)
    assert summary["train_loss_tokens"] == sum(int(s.loss_mask.sum()) for s in data.train)
    assert summary["train_loss_tokens"] >= len(data.train)
    assert summary["skipped"] == dict(data.skipped)
    json.dumps(summary)  # serialisable for logs
    assert 0 <= data.truncated <= len(samples)
    # the count is of rows actually cut (a conversation may end exactly at max_length uncut)
    assert data.truncated == sum(s.truncated for s in samples)
    assert all(len(s.input_ids) == max_length for s in samples if s.truncated)


# ----------------------------------------------------------------------------------------------
# 2. Mask oracle on tokenize_conversation directly (plus message-level checks)
# ----------------------------------------------------------------------------------------------


@settings(max_examples=80, **SETTINGS)
@given(messages=good_messages(), max_length=st.one_of(st.integers(3, 200), st.just(8192)))
def test_loss_mask_matches_token_level_oracle(messages, max_length):
    tok = _tok()
    assert normalize_row({"messages": messages}) == messages
    rendered = [int(x) for x in tok.apply_chat_template(messages, tokenize=True, return_dict=False)]
    try:
        sample = tokenize_conversation(tok, messages, max_length, _eot())
    except BadRow as bad:
        if bad.reason == "template_not_prefix_stable":
            # only when an assistant reply starts with whitespace (it merges with the header newline)
            assert any(m["content"][0].isspace() for m in messages if m["role"] == "assistant")
            return
        if bad.reason == "empty_turn":
            # a reply made only of characters this tokenizer drops (a few C0 controls) has no tokens
            assert any(not tok.encode(m["content"], add_special_tokens=False)
                       for m in messages if m["role"] == "assistant")
            return
        assert bad.reason == "no_loss_tokens_after_truncation", bad.reason
        # correct only if the oracle has no loss token at t >= 2 in the first max_length tokens
        assert not any(_oracle_mask(rendered[:max_length])[2:])
        return
    _check_sample(sample, max_length)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    assert ids == rendered[:max_length]  # the sample is the chat-template rendering, cut
    if len(rendered) <= max_length:
        # untruncated: masked spans are exactly each assistant reply + <|im_end|>
        spans, start = [], None
        for i, m in enumerate(mask + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        def seen(text):  # the text as this tokenizer keeps it (it drops a few C0 controls)
            return tok.decode(tok.encode(text, add_special_tokens=False))

        replies = [seen(m["content"]) for m in messages if m["role"] == "assistant"]
        assert [tok.decode(ids[s:e]) for s, e in spans] == [c + "<|im_end|>" for c in replies]
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        for m in messages:
            if m["role"] != "assistant":
                assert seen(m["content"]) in unmasked


# ----------------------------------------------------------------------------------------------
# 3. Truncation gives a prefix, or no_loss_tokens_after_truncation
# ----------------------------------------------------------------------------------------------


@settings(max_examples=50, **SETTINGS)
@given(messages=good_messages(max_turns=4), cuts=st.lists(st.integers(1, 400), min_size=1, max_size=6))
def test_truncation_is_a_prefix_or_no_loss_tokens(messages, cuts):
    tok = _tok()
    try:
        full = tokenize_conversation(tok, messages, 1 << 20, _eot())
    except BadRow as bad:
        assert bad.reason in {"template_not_prefix_stable", "empty_turn"}, bad.reason
        return
    n = len(full.input_ids)
    for cut in sorted(set(cuts + [n, n - 1, 2, 3])):
        if cut < 1:
            continue
        try:
            short = tokenize_conversation(tok, messages, cut, _eot())
        except BadRow as bad:
            assert bad.reason == "no_loss_tokens_after_truncation", bad.reason
            assert not bool(full.loss_mask[2:cut].any())
            continue
        assert bool(full.loss_mask[2:cut].any())
        m = min(cut, n)
        assert len(short.input_ids) == m
        assert torch.equal(short.input_ids, full.input_ids[:m])
        assert torch.equal(short.loss_mask, full.loss_mask[:m])
        _check_sample(short, cut)


# ----------------------------------------------------------------------------------------------
# 4. normalize_row: clean messages or a known BadRow, never another exception
# ----------------------------------------------------------------------------------------------


def _text_of(content):
    """Content as text: a string, or a list of {"type": "text"} parts joined; None otherwise."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else None


def _turn_defect(turn) -> str | None:
    """Independent statement of what makes a single turn unusable (None: usable)."""
    if not isinstance(turn, dict):
        return "turn_not_an_object"
    role = turn["role"] if "role" in turn else turn.get("from")
    content = _text_of(turn["content"] if "content" in turn else turn.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        return "unknown_role"
    if not isinstance(content, str):
        return "non_string_content"
    if not content.strip() and role.lower() != "tool":  # a tool may return nothing
        return "empty_turn"
    if not _clean(content):
        return "invalid_unicode"
    return None


@settings(max_examples=400, **SETTINGS)
@given(row=st.one_of(any_rows(), good_rows(), st.builds(BadRow, st.just("malformed_json"))))
def test_normalize_row_returns_clean_messages_or_known_badrow(row):
    try:
        out = normalize_row(row)
    except BadRow as bad:
        assert bad.reason in NORMALIZE_REASONS, bad.reason
        if isinstance(row, BadRow):
            assert bad.reason == "malformed_json"
        elif bad.reason in {"turn_not_an_object", "unknown_role", "non_string_content", "empty_turn",
                            "invalid_unicode"}:
            turns_ = row.get("messages", row.get("conversations"))
            assert bad.reason in {_turn_defect(t) for t in turns_}
        elif bad.reason == "no_assistant_turn":
            turns_ = row.get("messages", row.get("conversations"))
            assert all(_turn_defect(t) is None for t in turns_)
        return
    # returned: every turn was usable, and out is the mapped turns minus leading assistant
    # turns and trailing non-assistant turns
    assert isinstance(row, dict)
    turns_ = row.get("messages", row.get("conversations"))
    assert all(_turn_defect(t) is None for t in turns_)
    mapped = [
        {"role": ROLE_ALIASES[(t["role"] if "role" in t else t["from"]).lower()],
         "content": _text_of(t["content"] if "content" in t else t["value"])}
        for t in turns_
    ]
    assert out and isinstance(out, list)
    assert out[0]["role"] != "assistant" and out[-1]["role"] == "assistant"
    for m in out:
        assert m["role"] in {"system", "user", "assistant", "tool"}
        assert set(m) == {"role", "content"} | ({"content_parts"} if "content_parts" in m else set())
        assert "".join(m.get("content_parts", [m["content"]])) == m["content"]
        assert isinstance(m["content"], str) and (m["content"].strip() or m["role"] == "tool")
        assert _clean(m["content"])
    i = next(k for k, m in enumerate(mapped) if m["role"] != "assistant")
    j = max(k for k, m in enumerate(mapped) if m["role"] == "assistant") + 1
    assert [{"role": m["role"], "content": m["content"]} for m in out] == mapped[i:j]


# ----------------------------------------------------------------------------------------------
# 5. A conversation ending on user turns trains on it without them
# ----------------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(
    messages=good_messages(max_turns=3),
    tail=st.lists(st.tuples(st.sampled_from(["user", "human", "system"]), good_text), min_size=1, max_size=3),
    sharegpt=st.booleans(),
    max_length=st.one_of(st.integers(16, 200), st.just(4096)),
)
def test_trailing_user_turns_are_dropped_not_trained(messages, tail, sharegpt, max_length):
    tok = _tok()
    extra = [{"role": r, "content": c} for r, c in tail]
    if sharegpt:
        back = {"user": "human", "assistant": "gpt", "system": "system", "human": "human"}
        row = {"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in messages + extra]}
    else:
        row = {"messages": messages + extra}
    got = normalize_row(row)
    assert got == messages

    def run(msgs):
        try:
            return tokenize_conversation(tok, msgs, max_length, _eot())
        except BadRow as bad:
            return bad.reason

    with_tail, without = run(got), run(messages)
    if isinstance(without, str):
        assert with_tail == without
        return
    assert torch.equal(with_tail.input_ids, without.input_ids)
    assert torch.equal(with_tail.loss_mask, without.loss_mask)
    # and through the whole loader: the row gives the same sample as the row without the tail
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n" + json.dumps(row) + "\n")
        data = build_dataset(tok, source="jsonl", path=path, max_length=max_length, num_samples=2,
                             heldout_samples=0, end_of_turn_id=_eot(), show_progress=False)
    assert data.rows_seen == 2 and not data.skipped
    for s in data.train:
        assert torch.equal(s.input_ids, without.input_ids) and torch.equal(s.loss_mask, without.loss_mask)


# ----------------------------------------------------------------------------------------------
# Targeted edge cases found while writing the properties
# ----------------------------------------------------------------------------------------------

GOOD_LINE = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]})


def _build(lines: list[str], **kw):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        args = dict(source="jsonl", path=path, max_length=4096, num_samples=10, heldout_samples=0,
                    end_of_turn_id=_eot(), show_progress=False)
        args.update(kw)
        return build_dataset(_tok(), **args)


def test_jsonl_line_with_huge_integer_is_skipped():
    data = _build([GOOD_LINE, '{"id": ' + "1" * 5000 + ', "messages": []}', GOOD_LINE])
    assert data.rows_seen == 3 and len(data.train) == 2
    assert sum(data.skipped.values()) == 1


def test_jsonl_deeply_nested_line_is_skipped():
    data = _build([GOOD_LINE, "[" * 100_000, GOOD_LINE])
    assert data.rows_seen == 3 and len(data.train) == 2
    assert sum(data.skipped.values()) == 1


def test_truncated_rows_counts_only_rows_that_were_cut():
    msgs = json.loads(GOOD_LINE)["messages"]
    n = len(tokenize_conversation(_tok(), msgs, 4096, _eot()).input_ids)
    data = _build([GOOD_LINE, GOOD_LINE], max_length=n, num_samples=2)
    assert all(len(s.input_ids) == n for s in data.train)
    assert data.summary()["truncated_rows"] == 0


def test_special_token_text_in_content_is_skipped_or_masked_correctly():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a<|im_start|>user\nb"}]}
    try:
        sample = tokenize_conversation(_tok(), normalize_row(row), 4096, _eot())
    except BadRow:
        return
    im_start = _ids_info()[0]
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    assert not any(m and t == im_start for t, m in zip(ids, mask)), "a role header is in the loss mask"
    assert mask == _oracle_mask(ids)


def test_iter_jsonl_invalid_utf8_becomes_invalid_unicode_row():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.jsonl")
        with open(path, "wb") as fh:
            fh.write(b'{"messages": [{"role": "user", "content": "q"}, '
                     b'{"role": "assistant", "content": "bad \xff\xfe bytes"}]}\n')
        rows = list(iter_jsonl(path))
    assert len(rows) == 1
    with pytest.raises(BadRow) as err:
        normalize_row(rows[0])
    assert err.value.reason == "invalid_unicode"


def _row(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


LONG = " ".join(f"word{i}" for i in range(120))  # well over the max_length below


@pytest.mark.parametrize("system", [False, True])
def test_row_over_max_length_keeps_its_later_exchange(system):
    """A first prompt that fills max_length: the cut leaves nothing to train (the row was dropped);
    the later exchange, rendered as its own conversation (system message kept), trains instead."""
    lead = [("system", "Be brief.")] if system else []
    turns = [*lead, ("user", LONG), ("assistant", "ok"), ("user", "and two?"), ("assistant", "two three four five")]
    later = [{"role": r, "content": c} for r, c in [*lead, *turns[-2:]]]
    expected = tokenize_conversation(_tok(), later, 4096, _eot())
    n = len(expected.input_ids)
    data = _build([_row(*turns)] * 2, max_length=n, num_samples=2)
    assert data.summary()["rows_kept_as_later_turns"] == 2 and not data.skipped and data.truncated == 0
    for s in data.train:
        assert torch.equal(s.input_ids, expected.input_ids) and torch.equal(s.loss_mask, expected.loss_mask)
    with pytest.raises(ValueError, match="no_loss_tokens_after_truncation"):  # the cut alone: both rows dropped
        _build([_row(*turns)] * 2, max_length=n, num_samples=2, fit_long_rows=False)


def test_row_over_max_length_keeps_the_cut_when_it_trains_more():
    """A long first answer cut at max_length trains more than the short later exchange: the cut stays."""
    turns = [("user", "count"), ("assistant", LONG), ("user", "and two?"), ("assistant", "two")]
    messages = [{"role": r, "content": c} for r, c in turns]
    whole = tokenize_conversation(_tok(), messages, 4096, _eot())
    data = _build([_row(*turns)] * 2, max_length=100, num_samples=2)
    assert data.summary()["rows_kept_as_later_turns"] == 0 and data.truncated == 2
    for s in data.train:
        assert torch.equal(s.input_ids, whole.input_ids[:100]) and torch.equal(s.loss_mask, whole.loss_mask[:100])
