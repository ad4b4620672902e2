"""Tests of the data pipeline: sources (JSON array / JSONL / HF), row normalisation,
chat-template tokenisation with the assistant loss mask, and dataset building.

The loss-mask golden tests use the real SmolLM2-135M-Instruct tokenizer (ChatML template).
The expected mask is built independently of `tokenize_conversation`: it is found by
searching the rendered token list for the `<|im_start|>assistant\n` header tokens and
marking everything after the header up to and including the next `<|im_end|>`.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from specforge_k25.data.dataset import TokenizedData, build_dataset
from specforge_k25.data.sources import (
    SHAREGPT_FILE,
    SHAREGPT_PACKAGE,
    BadRow,
    iter_json_array,
    iter_jsonl,
    iter_source,
    normalize_row,
    package_file,
)
from specforge_k25.data.tokenize import Sample, tokenize_conversation


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.models import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def eot(tok) -> int:
    """`<|im_end|>` id, found by converting the token (not assumed)."""
    eot_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert eot_id == tok.eos_token_id == 2
    return eot_id


def _ids(out) -> list[int]:
    """apply_chat_template may return a list, a dict or a BatchEncoding."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(x) for x in out]


def _header(tok) -> list[int]:
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert header[0] == tok.convert_tokens_to_ids("<|im_start|>")
    return header


def _expected_mask(ids: list[int], header: list[int], eot_id: int) -> list[bool]:
    """Independent mask: after each `<|im_start|>assistant\\n` header, up to and including the
    first `<|im_end|>`."""
    mask = [False] * len(ids)
    h = len(header)
    for p in range(len(ids) - h + 1):
        if ids[p : p + h] == header:
            t = p + h
            while t < len(ids):
                mask[t] = True
                if ids[t] == eot_id:
                    break
                t += 1
    return mask


def _spans(mask: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


TWO_TURN = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


# ----------------------------------------------------------------------------------------------
# iter_json_array
# ----------------------------------------------------------------------------------------------

# Items chosen to be hard for a streaming parser: brackets, commas and escaped quotes inside
# strings, nested arrays, unicode, literals. No top-level numbers (see the xfail test below).
ARRAY_ITEMS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi, [there]"}]},
    "a string with \"quotes\", commas ] and [ brackets",
    [1, [2, 3], {"k": "v"}],
    {"unicode": "héllo — 你好 😀", "n": 12345, "f": -1.5e3},
    True,
    None,
    {"empty": {}, "list": []},
    {"id": "last", "conversations": [{"from": "gpt", "value": "bye"}]},
]


def _array_text(items) -> str:
    return "[\n  " + ",\n  ".join(json.dumps(it, ensure_ascii=False) for it in items) + "\n]\n"


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 13, 1 << 20])
def test_json_array_complete_all_items_any_chunk_size(tmp_path, chunk_chars):
    path = tmp_path / "a.json"
    path.write_text(_array_text(ARRAY_ITEMS), encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == ARRAY_ITEMS


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_json_array_truncated_mid_item_yields_complete_items(tmp_path, chunk_chars):
    head = _array_text(ARRAY_ITEMS[:-1]).rstrip().rstrip("]").rstrip() + ",\n  "
    last = json.dumps(ARRAY_ITEMS[-1])
    path = tmp_path / "t.json"
    # Cut at every position strictly inside the last item: only the complete items come out.
    for cut in range(1, len(last)):
        path.write_text(head + last[:cut], encoding="utf-8")
        got = list(iter_json_array(path, chunk_chars=chunk_chars))
        assert got == ARRAY_ITEMS[:-1], f"cut={cut}"
    # Complete last item but no closing bracket: everything comes out.
    path.write_text(head + last, encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == ARRAY_ITEMS
    # Cut just after a separator.
    path.write_text(head, encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == ARRAY_ITEMS[:-1]


def test_json_array_empty_array(tmp_path):
    path = tmp_path / "e.json"
    path.write_text("[ ]", encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=2)) == []


@pytest.mark.parametrize("text", ['{"a": 1}', "", "   \n", "hello"])
def test_json_array_not_an_array_raises(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError):
        list(iter_json_array(path))


def test_json_array_object_containing_array_raises(tmp_path):
    path = tmp_path / "o.json"
    path.write_text('{"a": [1, 2]}', encoding="utf-8")
    with pytest.raises(ValueError):
        list(iter_json_array(path))


def test_json_array_number_items_straddling_chunks(tmp_path):
    path = tmp_path / "n.json"
    path.write_text("[10, 20]", encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=2)) == [10, 20]


def test_json_array_leading_whitespace_longer_than_chunk(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(" " * 20 + '[{"a": 1}]', encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=7)) == [{"a": 1}]


# ----------------------------------------------------------------------------------------------
# Packaged ShareGPT
# ----------------------------------------------------------------------------------------------


def test_package_file_missing():
    with pytest.raises(FileNotFoundError):
        package_file("no_such_package_specforge_k25_xyz", "x.json")
    with pytest.raises(FileNotFoundError):
        package_file(SHAREGPT_PACKAGE, "data/definitely_missing.json")


def test_sharegpt_packaged_parses():
    path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    # The file is truncated: it does not end with the closing bracket.
    with open(path, "rb") as fh:
        fh.seek(-64, 2)
        assert not fh.read().rstrip().endswith(b"]")
    n = 0
    for item in iter_source("sharegpt", None):
        assert isinstance(item, dict)
        assert isinstance(item.get("conversations"), list)
        n += 1
    assert n > 17_000
    assert n == 17_671  # the count recorded in reference/embedded_data.md
    # The chunk size does not change the result on the real file.
    assert sum(1 for _ in iter_json_array(path, chunk_chars=1 << 16)) == n


# ----------------------------------------------------------------------------------------------
# iter_jsonl
# ----------------------------------------------------------------------------------------------


def test_iter_jsonl_malformed_and_blank(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n   \n{not json\n[1, 2]\n\t\n"s"\n{"b": 2}', encoding="utf-8")
    rows = list(iter_jsonl(path))
    assert len(rows) == 5
    assert rows[0] == {"a": 1}
    assert isinstance(rows[1], BadRow) and rows[1].reason == "malformed_json"
    assert rows[2] == [1, 2] and rows[3] == "s" and rows[4] == {"b": 2}
    # The marker goes through normalize_row as the same BadRow.
    with pytest.raises(BadRow) as err:
        normalize_row(rows[1])
    assert err.value.reason == "malformed_json"


# ----------------------------------------------------------------------------------------------
# normalize_row
# ----------------------------------------------------------------------------------------------

U = {"role": "user", "content": "hello"}
A = {"role": "assistant", "content": "hi there"}

BAD_ROWS = [
    ("list_row", [U, A], "not_an_object"),
    ("string_row", "hello", "not_an_object"),
    ("none_row", None, "not_an_object"),
    ("no_key", {"id": 1}, "no_turns"),
    ("empty_messages", {"messages": []}, "no_turns"),
    ("messages_not_list", {"messages": "hi"}, "no_turns"),
    ("empty_conversations", {"conversations": []}, "no_turns"),
    ("turn_not_dict", {"messages": [U, "hi"]}, "turn_not_an_object"),
    ("unknown_role", {"messages": [U, {"role": "function", "content": "x"}, A]}, "unknown_role"),
    ("unknown_from", {"conversations": [{"from": "bing", "value": "x"}]}, "unknown_role"),
    ("missing_role", {"messages": [{"content": "x"}, A]}, "unknown_role"),
    ("non_str_role", {"messages": [{"role": 3, "content": "x"}, A]}, "unknown_role"),
    ("int_content", {"messages": [U, {"role": "assistant", "content": 5}]}, "non_string_content"),
    ("none_content", {"messages": [{"role": "user", "content": None}, A]}, "non_string_content"),
    ("list_content", {"messages": [U, {"role": "assistant", "content": ["a"]}]}, "non_string_content"),
    ("part_without_type", {"messages": [{"role": "user", "content": [{"text": "q"}]}, A]}, "non_string_content"),
    ("text_part_not_str", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}, A]},
     "non_string_content"),
    ("image_part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"},
                                                             {"type": "image_url", "image_url": {"url": "u"}}]}, A]},
     "non_text_content"),
    ("null_content_no_calls", {"messages": [U, {"role": "assistant", "content": None}]}, "non_string_content"),
    ("null_tool_result", {"messages": [U, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": None}, A]}, "non_string_content"),
    ("tool_calls_not_list", {"messages": [U, {"role": "assistant", "content": "", "tool_calls": "f()"}]},
     "malformed_tool_calls"),
    ("tool_call_no_name", {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"arguments": "{}"}}]}]}, "malformed_tool_calls"),
    ("tool_call_args_not_json", {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: Paris"}}]}]}, "malformed_tool_calls"),
    ("tool_call_args_not_object", {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}]}, "malformed_tool_calls"),
    ("tool_call_args_nan", {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"x": NaN}'}}]}]}, "malformed_tool_calls"),
    ("empty_content", {"messages": [U, {"role": "assistant", "content": ""}]}, "empty_turn"),
    ("blank_content", {"messages": [{"role": "user", "content": " \n\t "}, A]}, "empty_turn"),
    ("lone_surrogate", {"messages": [U, {"role": "assistant", "content": "ok \ud800 no"}]}, "invalid_unicode"),
    ("low_surrogate", {"messages": [{"role": "user", "content": "x\udfff"}, A]}, "invalid_unicode"),
    ("replacement_char", {"messages": [U, {"role": "assistant", "content": "bad \ufffd"}]}, "invalid_unicode"),
    ("only_user", {"messages": [U]}, "no_assistant_turn"),
    ("system_user", {"messages": [{"role": "system", "content": "s"}, U]}, "no_assistant_turn"),
    ("only_assistant", {"messages": [A, A]}, "no_assistant_turn"),
    ("assistant_then_user", {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
     "no_assistant_turn"),
]


@pytest.mark.parametrize("row,reason", [(r, why) for _, r, why in BAD_ROWS], ids=[n for n, _, _ in BAD_ROWS])
def test_normalize_row_bad(row, reason):
    with pytest.raises(BadRow) as err:
        normalize_row(row)
    assert err.value.reason == reason
    assert isinstance(err.value, ValueError)


GOOD_ROWS = [
    (
        "sharegpt_mapping",
        {"id": "x", "conversations": [
            {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"}, {"from": "chatgpt", "value": "a2"},
        ]},
        [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")],
    ),
    (
        "sharegpt_system_and_case",
        {"conversations": [
            {"from": "system", "value": "s"}, {"from": "Human", "value": "q"}, {"from": "GPT", "value": "a"},
        ]},
        [("system", "s"), ("user", "q"), ("assistant", "a")],
    ),
    (
        "openai_messages",
        {"messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]},
        [("system", "s"), ("user", "q"), ("assistant", "a")],
    ),
    (
        "leading_assistant_dropped",
        {"messages": [
            {"role": "assistant", "content": "greeting"}, {"role": "assistant", "content": "again"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        ]},
        [("user", "q"), ("assistant", "a")],
    ),
    (
        "trailing_user_dropped",
        {"conversations": [
            {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
            {"from": "human", "value": "unanswered"}, {"from": "human", "value": "still"},
        ]},
        [("user", "q"), ("assistant", "a")],
    ),
    (
        "messages_preferred_over_conversations",
        {"messages": [U, A], "conversations": [{"from": "bing", "value": "x"}]},
        [("user", "hello"), ("assistant", "hi there")],
    ),
]


@pytest.mark.parametrize("row,expected", [(r, e) for _, r, e in GOOD_ROWS], ids=[n for n, _, _ in GOOD_ROWS])
def test_normalize_row_good(row, expected):
    out = normalize_row(row)
    assert out == [{"role": r, "content": c} for r, c in expected]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# rows as public chat datasets keep them -> the messages the renderers get, written out by hand
REAL_WORLD_ROWS = [
    ("content_parts_joined",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " you"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "Hi", "image_url": None}]}]},
     [{"role": "user", "content": "Hello you", "content_parts": ["Hello", " you"]},
      {"role": "assistant", "content": "Hi", "content_parts": ["Hi"]}]),
    ("developer_is_system",
     {"messages": [{"role": "developer", "content": "French."}, U, A]},
     [{"role": "system", "content": "French."}, U, A]),
    ("tool_call_null_content_and_result",
     {"messages": [U, {"role": "assistant", "content": None, "tool_calls": [{**CALL, "extra": 1}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]}, A]},
     [U, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "18C", "content_parts": ["18C"], "tool_call_id": "call_1"}, A]),
    ("datasets_none_columns",  # `datasets` gives every message every column
     {"messages": [{"role": "user", "content": "hello", "tool_calls": None, "tool_call_id": None},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": None, "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
                    "tool_call_id": None},
                   {"role": "tool", "content": "", "tool_calls": None, "tool_call_id": None},
                   {"role": "assistant", "content": "hi there", "tool_calls": [], "tool_call_id": None}]},
     [U, {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
      {"role": "tool", "content": ""}, A]),
    ("trailing_tool_result_dropped",
     {"messages": [U, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
                   {"role": "tool", "content": "18C"}]},
     [U, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]),
]


@pytest.mark.parametrize("row,expected", [(r, e) for _, r, e in REAL_WORLD_ROWS],
                         ids=[n for n, _, _ in REAL_WORLD_ROWS])
def test_normalize_row_real_world_shapes(row, expected):
    assert normalize_row(row) == expected


# ----------------------------------------------------------------------------------------------
# tokenize_conversation (real SmolLM2 tokenizer, ChatML)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_system", [True, False])
def test_tokenize_golden_mask(tok, eot, with_system):
    messages = TWO_TURN if with_system else TWO_TURN[1:]
    sample = tokenize_conversation(tok, messages, max_length=4096, end_of_turn_id=eot)
    assert isinstance(sample, Sample)
    assert sample.input_ids.dtype == torch.int64 and sample.loss_mask.dtype == torch.bool
    assert sample.input_ids.shape == sample.loss_mask.shape and sample.input_ids.dim() == 1

    ids = sample.input_ids.tolist()
    mask = sample.loss_mask.tolist()
    # input_ids are exactly the chat-template rendering (default system turn included when absent).
    assert ids == _ids(tok.apply_chat_template(messages, tokenize=True))
    if not with_system:
        assert "<|im_start|>system\n" in tok.decode(ids)

    # Expected mask by header search (method described in the module docstring).
    expected = _expected_mask(ids, _header(tok), eot)
    assert mask == expected

    # Decoded masked spans: exactly each assistant content followed by <|im_end|>.
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    spans = _spans(mask)
    assert [tok.decode(ids[s:e]) for s, e in spans] == [c + "<|im_end|>" for c in assistant]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "".join(c + "<|im_end|>" for c in assistant)
    # Second independent check: tokenising each assistant piece on its own gives the same span.
    for (s, e), content in zip(spans, assistant):
        assert ids[s:e] == tok.encode(content, add_special_tokens=False) + [eot]
        assert ids[e - 1] == eot and not mask[e] and tok.decode([ids[e]]) == "\n"
        assert tok.decode(ids[s - len(_header(tok)) : s]) == "<|im_start|>assistant\n"
    # Nothing of the system/user text is masked.
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked


def test_tokenize_truncation(tok, eot):
    full = tokenize_conversation(tok, TWO_TURN, max_length=4096, end_of_turn_id=eot)
    n = len(full.input_ids)
    spans = _spans(full.loss_mask.tolist())
    assert len(spans) == 2
    # Cut inside the second assistant turn.
    cut = spans[1][0] + 1
    assert cut < n
    short = tokenize_conversation(tok, TWO_TURN, max_length=cut, end_of_turn_id=eot)
    assert len(short.input_ids) == len(short.loss_mask) == cut
    assert torch.equal(short.input_ids, full.input_ids[:cut])
    assert torch.equal(short.loss_mask, full.loss_mask[:cut])
    # A cut after exactly one assistant token still gives a sample.
    one = tokenize_conversation(tok, TWO_TURN, max_length=spans[0][0] + 1, end_of_turn_id=eot)
    assert int(one.loss_mask.sum()) == 1
    # A cut at the first assistant token leaves no loss token.
    with pytest.raises(BadRow) as err:
        tokenize_conversation(tok, TWO_TURN, max_length=spans[0][0], end_of_turn_id=eot)
    assert err.value.reason == "no_loss_tokens_after_truncation"
    with pytest.raises(BadRow) as err:
        tokenize_conversation(tok, TWO_TURN, max_length=3, end_of_turn_id=eot)
    assert err.value.reason == "no_loss_tokens_after_truncation"


def test_tokenize_wrong_end_of_turn_id(tok, eot):
    wrong = tok.convert_tokens_to_ids("<|endoftext|>")
    assert wrong != eot
    with pytest.raises(BadRow) as err:
        tokenize_conversation(tok, TWO_TURN, max_length=4096, end_of_turn_id=wrong)
    assert err.value.reason == "no_end_of_turn_token"


class _UnstableTemplate:
    """A stub whose rendering of a longer conversation is not an extension of the shorter one."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, return_dict):
        out = [len(messages) + 100]  # the first token depends on the number of turns
        for m in messages:
            out += [10 if m["role"] == "user" else 11, 5, 7]
        if add_generation_prompt:
            out.append(11)
        return out


def test_tokenize_rejects_non_prefix_stable_template():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(BadRow) as err:
        tokenize_conversation(_UnstableTemplate(), msgs, max_length=100, end_of_turn_id=7)
    assert err.value.reason == "template_not_prefix_stable"


# ----------------------------------------------------------------------------------------------
# build_dataset
# ----------------------------------------------------------------------------------------------


def _good(i: int) -> dict:
    if i % 2:
        return {"conversations": [{"from": "human", "value": f"Question number {i}?"},
                                  {"from": "gpt", "value": f"Answer number {i}."}]}
    return {"messages": [{"role": "system", "content": f"System {i}."},
                         {"role": "user", "content": f"Question number {i}?"},
                         {"role": "assistant", "content": f"Answer number {i}."}]}


MAX_LEN = 64


def _write_mixed(path: Path) -> int:
    """10 good rows (one of them truncated), each kind of bad row, blank lines, one trailing
    malformed line after the last good row. Returns the number of non-blank lines before it."""
    long_answer = {"messages": [{"role": "user", "content": "Tell me a long story."},
                                {"role": "assistant", "content": "once upon a time " * 60}]}
    bad = [
        "{this is not json",                                                           # malformed_json
        json.dumps([1, 2]),                                                            # not_an_object
        json.dumps({"messages": []}),                                                  # no_turns
        json.dumps({"messages": ["hi", A]}),                                           # turn_not_an_object
        json.dumps({"messages": [U, {"role": "narrator", "content": "x"}, A]}),        # unknown_role
        json.dumps({"messages": [U, {"role": "assistant", "content": 7}]}),            # non_string_content
        json.dumps({"messages": [U, {"role": "assistant", "content": "   "}]}),        # empty_turn
        json.dumps({"messages": [U, {"role": "assistant", "content": "x\ud800"}]}),    # invalid_unicode (escape)
        json.dumps({"messages": [{"role": "user", "content": "q"}]}),                  # no_assistant_turn
        json.dumps({"messages": [{"role": "user", "content": "word " * 200}, A]}),     # no_loss_tokens_after_truncation
    ]
    lines: list[bytes] = []
    good = [json.dumps(_good(i)) for i in range(9)] + [json.dumps(long_answer)]
    for i, g in enumerate(good):
        lines.append(bad[i].encode())
        lines.append(g.encode())
        if i == 3:
            lines.append(b"")  # blank
            lines.append(b"   ")
    # Raw invalid UTF-8 bytes inside a string: decoded with errors="replace" -> U+FFFD.
    lines.insert(1, b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x\xff\xfe"}]}')
    counted = sum(1 for ln in lines if ln.strip())
    lines.append(b"trailing garbage")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return counted


EXPECTED_SKIPS = Counter({
    "malformed_json": 1, "not_an_object": 1, "no_turns": 1, "turn_not_an_object": 1,
    "unknown_role": 1, "non_string_content": 1, "empty_turn": 1, "invalid_unicode": 2,
    "no_assistant_turn": 1, "no_loss_tokens_after_truncation": 1,
})


def _check_samples(data: TokenizedData):
    for s in data.train + data.heldout:
        assert isinstance(s, Sample)
        assert 0 < len(s.input_ids) <= MAX_LEN and len(s.loss_mask) == len(s.input_ids)
        assert bool(s.loss_mask[2:].any())
    train = {tuple(s.input_ids.tolist()) for s in data.train}
    held = {tuple(s.input_ids.tolist()) for s in data.heldout}
    assert len(train) == len(data.train) and len(held) == len(data.heldout)  # rows are distinct
    assert not train & held


def test_build_dataset_jsonl_mixed(tok, eot, tmp_path):
    path = tmp_path / "mixed.jsonl"
    counted = _write_mixed(path)
    kw = dict(source="jsonl", path=str(path), max_length=MAX_LEN, end_of_turn_id=eot, show_progress=False)

    # Enough good rows: stops after the 10th good sample (the trailing line is never read).
    data = build_dataset(tok, num_samples=7, heldout_samples=3, **kw)
    assert isinstance(data, TokenizedData)
    assert data.skipped == EXPECTED_SKIPS
    assert data.rows_seen == counted == 10 + sum(EXPECTED_SKIPS.values())
    assert len(data.train) == 7 and len(data.heldout) == 3
    assert data.truncated == 1
    _check_samples(data)
    summary = data.summary()
    assert summary["train_samples"] == 7 and summary["heldout_samples"] == 3
    assert summary["skipped"] == dict(EXPECTED_SKIPS)

    # Same seed, same split.
    again = build_dataset(tok, num_samples=7, heldout_samples=3, **kw)
    assert [s.input_ids.tolist() for s in again.heldout] == [s.input_ids.tolist() for s in data.heldout]

    # Source exhausted before the wanted count: held-out is capped at a fifth of the samples.
    data = build_dataset(tok, num_samples=100, heldout_samples=3, **kw)
    assert data.skipped == EXPECTED_SKIPS + Counter({"malformed_json": 1})
    assert data.rows_seen == counted + 1
    assert len(data.heldout) == 2 and len(data.train) == 8
    _check_samples(data)

    # max_rows_scanned stops early: the first 5 lines hold 2 good rows and 3 bad ones.
    data = build_dataset(tok, num_samples=100, heldout_samples=0, max_rows_scanned=5, **kw)
    assert data.rows_seen == 5
    assert len(data.train) + len(data.heldout) == 2
    assert data.skipped == Counter({"malformed_json": 1, "invalid_unicode": 1, "not_an_object": 1})


def test_build_dataset_errors(tok, eot, tmp_path):
    kw = dict(max_length=MAX_LEN, num_samples=2, heldout_samples=1, end_of_turn_id=eot, show_progress=False)
    with pytest.raises(FileNotFoundError):
        build_dataset(tok, source="jsonl", path=str(tmp_path / "missing.jsonl"), **kw)
    with pytest.raises(FileNotFoundError):
        build_dataset(tok, source="jsonl", path=None, **kw)
    with pytest.raises(ValueError, match="expected one of"):
        build_dataset(tok, source="bogus", path=None, **kw)
    # Fewer than two usable samples.
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(_good(1)) + "\n" + json.dumps({"messages": []}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="usable samples"):
        build_dataset(tok, source="jsonl", path=str(one), **kw)


def test_a_source_too_short_for_any_held_out_row_is_refused_unless_none_is_asked(tok, eot, tmp_path):
    """3 usable rows: a fifth of them is no held-out row. A run asked to evaluate is refused (it
    would end without its held-out numbers); data.heldout_samples=0 trains on all three."""
    three = tmp_path / "three.jsonl"
    three.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(3)), encoding="utf-8")
    kw = dict(source="jsonl", path=str(three), max_length=MAX_LEN, num_samples=10, end_of_turn_id=eot,
              show_progress=False)
    with pytest.raises(ValueError, match=r"none of the data.heldout_samples=2; add rows, or set "
                                         r"data.heldout_samples=0 to train on all 3 without a held-out evaluation"):
        build_dataset(tok, heldout_samples=2, **kw)
    data = build_dataset(tok, heldout_samples=0, **kw)
    assert len(data.train) == 3 and data.heldout == []


# ----------------------------------------------------------------------------------------------
# Hugging Face `datasets` on a local folder (offline)
# ----------------------------------------------------------------------------------------------


def test_iter_source_hf_local_folder(tok, eot, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")

    folder = tmp_path / "local_ds"
    folder.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": f"Hi {i}!"}]}
        for i in range(6)
    ]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    got = list(iter_source("hf", str(folder)))
    assert got == rows
    assert [normalize_row(r) for r in got] == [r["messages"] for r in rows]
    assert (tmp_path / "hf_cache").exists()  # nothing written to the user's cache

    data = build_dataset(tok, source="hf", path=str(folder), max_length=MAX_LEN, num_samples=4,
                         heldout_samples=2, end_of_turn_id=eot, show_progress=False)
    assert len(data.train) == 4 and len(data.heldout) == 2 and not data.skipped

    with pytest.raises(ValueError):
        list(iter_source("hf", None))
