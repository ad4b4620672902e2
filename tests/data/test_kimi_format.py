"""Tests of the Kimi-K2.5 chat-format renderer (`data/kimi_format.py`) and the local
tiktoken stand-in with Kimi's special tokens at their real ids (`data/kimi_tokenizer.py`).

Golden tests: the expected token ids and loss mask of every case are written out by hand from
the format of docs/KIMI_K25.md §4 and §5: special-token ids as literal numbers, ordinary text
as `E(text)` (the tokenizer's plain encoding of that text run), each piece with its mask bit.

Assumptions these tests pin (see kimi_format's module doc):
* thinking mode: `<think>` ends the generation prompt (mask 0); reasoning and `</think>` are
  generated (mask 1);
* instant mode: the empty `<think></think>` is template-inserted (mask 0);
* earlier turns keep only `<think></think>{answer}`; their answer, tool calls and `<|im_end|>`
  are supervised by default;
* in thinking mode the reasoning of the current tool-call loop (assistant turns after the last
  assistant turn without tool calls) is kept;
* tool results: `<|im_system|>tool<|im_middle|>{content}<|im_end|>`, never supervised.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specforge_k25.data.dataset import build_dataset
from specforge_k25.data.kimi_format import (
    KimiFormat,
    KimiSpecialTokens,
    kimi_renderer,
    render_kimi,
    special_tokens_of,
)
from specforge_k25.data.kimi_tokenizer import VOCAB_END, build_kimi_local_tokenizer
from specforge_k25.data.sources import BadRow, normalize_row

# Kimi-K2.5 special-token ids, literal (docs/KIMI_K25.md §4).
BOS = 163584
IM_END = 163586
IM_USER = 163587
IM_ASSISTANT = 163588
IM_SYSTEM = 163594
TC_SECTION_BEGIN = 163595
TC_SECTION_END = 163596
TC_BEGIN = 163597
TC_ARG = 163598
TC_END = 163599
IM_MIDDLE = 163601
THINK = 163606
THINK_END = 163607
HEADERS = {IM_SYSTEM, IM_USER, IM_ASSISTANT}


@pytest.fixture(scope="module")
def tok():
    return build_kimi_local_tokenizer()


@pytest.fixture(scope="module")
def E(tok):
    return tok.encode_ordinary


def seq(*parts):
    """parts: (ids, bit) -> (ids, mask) lists."""
    ids, mask = [], []
    for piece, bit in parts:
        ids += list(piece)
        mask += [bool(bit)] * len(piece)
    return ids, mask


def rendered(tok, messages, mode, max_length=4096, **kw):
    s = render_kimi(tok, messages, max_length, mode=mode, **kw)
    assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
    return s.input_ids.tolist(), s.loss_mask.tolist()


SYS = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 2+2?"}


# ----------------------------------------------------------------------------------------------
# The local tokenizer
# ----------------------------------------------------------------------------------------------


def test_local_tokenizer_has_kimi_special_ids(tok):
    table = tok._special_tokens
    assert table["[BOS]"] == 163584 and table["[EOS]"] == 163585 and table["<|im_end|>"] == 163586
    assert table["<|im_user|>"] == 163587 and table["<|im_assistant|>"] == 163588
    assert table["<|im_system|>"] == 163594 and table["<|im_middle|>"] == 163601
    assert [table[t] for t in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                               "<|tool_call_argument_begin|>", "<|tool_call_end|>")] == list(range(163595, 163600))
    assert table["<think>"] == 163606 and table["</think>"] == 163607 and table["[PAD]"] == 163839
    assert tok.n_vocab == VOCAB_END == 163840
    assert special_tokens_of(tok) == KimiSpecialTokens()
    text = "Hello, world! 12345 日本語 émoji 🤖 {\"a\": 1}\n"
    ids = tok.encode_ordinary(text)
    assert max(ids) < 8192 and tok.decode(ids) == text
    assert tok.encode("<|im_end|><think>", allowed_special="all") == [IM_END, THINK]


# ----------------------------------------------------------------------------------------------
# Golden cases
# ----------------------------------------------------------------------------------------------


def test_golden_system_user_assistant_instant(tok, E):
    ids, mask = rendered(tok, [SYS, USER, {"role": "assistant", "content": "4."}], "instant")
    assert (ids, mask) == seq(
        ([IM_SYSTEM], 0), (E("system"), 0), ([IM_MIDDLE], 0), (E("Be brief."), 0), ([IM_END], 0),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("What is 2+2?"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
        (E("4."), 1), ([IM_END], 1),
    )


def test_golden_thinking_reasoning_on_last_turn(tok, E):
    msgs = [SYS, USER, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]
    ids, mask = rendered(tok, msgs, "thinking")
    assert (ids, mask) == seq(
        ([IM_SYSTEM], 0), (E("system"), 0), ([IM_MIDDLE], 0), (E("Be brief."), 0), ([IM_END], 0),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("What is 2+2?"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0),
        ([THINK], 0),  # end of the thinking-mode generation prompt
        (E("Add them."), 1), ([THINK_END], 1), (E("4."), 1), ([IM_END], 1),
    )


TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye!", "reasoning_content": "Say bye."},
]


def test_golden_two_turns_first_reasoning_dropped(tok, E):
    ids, mask = rendered(tok, TWO_TURNS, "thinking")
    assert (ids, mask) == seq(
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Hi"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
        (E("Hello!"), 1), ([IM_END], 1),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Bye"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0),
        (E("Say bye."), 1), ([THINK_END], 1), (E("Goodbye!"), 1), ([IM_END], 1),
    )
    assert "Greet back." not in tok.decode(ids)
    # supervise_history=False: only the final turn is trained on
    ids2, mask2 = rendered(tok, TWO_TURNS, "thinking", fmt=KimiFormat(supervise_history=False))
    assert ids2 == ids
    first_end = ids.index(IM_END, ids.index(IM_ASSISTANT))
    assert not any(mask2[: first_end + 1]) and mask2[first_end + 1:] == mask[first_end + 1:]


def test_golden_instant_empty_think_not_supervised(tok, E):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}]
    ids, mask = rendered(tok, msgs, "instant")
    assert (ids, mask) == seq(
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Hi"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0), ([THINK_END], 0),
        (E("Hello!"), 1), ([IM_END], 1),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Bye"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0), ([THINK_END], 0),
        (E("Goodbye!"), 1), ([IM_END], 1),
    )
    think_positions = [t for t, i in enumerate(ids) if i in (THINK, THINK_END)]
    assert len(think_positions) == 4 and not any(mask[t] for t in think_positions)


def _call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
     "tool_calls": [_call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "content": "Sunny, 21C", "tool_call_id": "functions.get_weather:0"},
    {"role": "assistant", "content": "Sunny, 21C.", "reasoning_content": "It is sunny."},
]


def test_golden_tool_calls_and_tool_result_thinking(tok, E):
    ids, mask = rendered(tok, TOOL_LOOP, "thinking")
    assert (ids, mask) == seq(
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Weather in Paris?"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0),
        (E("Need weather."), 1), ([THINK_END], 1),  # same tool-call loop as the final turn: kept
        ([TC_SECTION_BEGIN, TC_BEGIN], 1), (E("functions.get_weather:0"), 1), ([TC_ARG], 1),
        (E('{"city": "Paris"}'), 1), ([TC_END, TC_SECTION_END], 1), ([IM_END], 1),
        ([IM_SYSTEM], 0), (E("tool"), 0), ([IM_MIDDLE], 0), (E("Sunny, 21C"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0),
        (E("It is sunny."), 1), ([THINK_END], 1), (E("Sunny, 21C."), 1), ([IM_END], 1),
    )
    # keep_reasoning="final": the tool-call turn loses its reasoning like any earlier turn
    ids2, mask2 = rendered(tok, TOOL_LOOP, "thinking", fmt=KimiFormat(keep_reasoning="final"))
    head_ids, head_mask = seq(
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Weather in Paris?"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
        ([TC_SECTION_BEGIN, TC_BEGIN], 1), (E("functions.get_weather:0"), 1), ([TC_ARG], 1),
    )
    assert (ids2[: len(head_ids)], mask2[: len(head_ids)]) == (head_ids, head_mask)
    assert "Need weather." not in tok.decode(ids2)


def test_golden_tool_calls_instant_indices_and_options(tok, E):
    msgs = [
        {"role": "user", "content": "Plan"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [_call("get_weather", {"city": "Oslo"}), _call("get_time", {})]},
        {"role": "tool", "content": "Rain", "tool_call_id": "functions.get_weather:0"},
        {"role": "tool", "content": "9am", "tool_call_id": "functions.get_time:1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "content": "8am", "tool_call_id": "functions.get_time:2"},
        {"role": "assistant", "content": "Rain at 9."},
    ]

    def tool_turn(text, prefix=""):
        return [([IM_SYSTEM], 0), (E("tool"), 0), ([IM_MIDDLE], 0), (E(prefix + text), 0), ([IM_END], 0)]

    def expected(idx, prefix_of=lambda cid: ""):
        return seq(
            ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Plan"), 0), ([IM_END], 0),
            ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
            (E("Checking."), 1), ([TC_SECTION_BEGIN], 1),
            ([TC_BEGIN], 1), (E(f"functions.get_weather:{idx[0]}"), 1), ([TC_ARG], 1), (E('{"city": "Oslo"}'), 1), ([TC_END], 1),
            ([TC_BEGIN], 1), (E(f"functions.get_time:{idx[1]}"), 1), ([TC_ARG], 1), (E("{}"), 1), ([TC_END], 1),
            ([TC_SECTION_END], 1), ([IM_END], 1),
            *tool_turn("Rain", prefix_of("functions.get_weather:0")),
            *tool_turn("9am", prefix_of("functions.get_time:1")),
            ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
            ([TC_SECTION_BEGIN], 1),
            ([TC_BEGIN], 1), (E(f"functions.get_time:{idx[2]}"), 1), ([TC_ARG], 1), (E('{"tz": "UTC"}'), 1), ([TC_END], 1),
            ([TC_SECTION_END], 1), ([IM_END], 1),
            *tool_turn("8am", prefix_of("functions.get_time:2")),
            ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
            (E("Rain at 9."), 1), ([IM_END], 1),
        )

    assert rendered(tok, msgs, "instant") == expected([0, 1, 2])  # global counter; "call_abc" replaced
    assert rendered(tok, msgs, "instant", fmt=KimiFormat(tool_call_index="per_message")) == expected([0, 1, 0])
    fmt = KimiFormat(tool_result_prefix="## Return of {tool_call_id}\n")
    assert rendered(tok, msgs, "instant", fmt=fmt) == expected([0, 1, 2], lambda cid: f"## Return of {cid}\n")
    # a call's own id in Kimi's form is kept verbatim
    own = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_time:7", "function": {"name": "get_time", "arguments": "{}"}}]}]
    ids, _ = rendered(tok, own, "instant")
    a = ids.index(TC_BEGIN) + 1
    assert ids[a: ids.index(TC_ARG)] == E("functions.get_time:7")


def test_golden_bos_and_default_system(tok, E):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids, mask = rendered(tok, msgs, "instant", fmt=KimiFormat(add_bos=True, default_system="You are Kimi."))
    assert (ids, mask) == seq(
        ([BOS], 0),
        ([IM_SYSTEM], 0), (E("system"), 0), ([IM_MIDDLE], 0), (E("You are Kimi."), 0), ([IM_END], 0),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("Hi"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK, THINK_END], 0),
        (E("Hello!"), 1), ([IM_END], 1),
    )


def test_golden_truncation(tok, E):
    msgs = [SYS, USER, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]
    full_ids, full_mask = seq(
        ([IM_SYSTEM], 0), (E("system"), 0), ([IM_MIDDLE], 0), (E("Be brief."), 0), ([IM_END], 0),
        ([IM_USER], 0), (E("user"), 0), ([IM_MIDDLE], 0), (E("What is 2+2?"), 0), ([IM_END], 0),
        ([IM_ASSISTANT], 0), (E("assistant"), 0), ([IM_MIDDLE], 0), ([THINK], 0),
        (E("Add them."), 1), ([THINK_END], 1), (E("4."), 1), ([IM_END], 1),
    )
    first_loss = full_mask.index(True)
    for cut in (len(full_ids) - 1, len(full_ids) - 3, first_loss + 1):
        assert rendered(tok, msgs, "thinking", max_length=cut) == (full_ids[:cut], full_mask[:cut])
    with pytest.raises(BadRow) as err:
        render_kimi(tok, msgs, first_loss, mode="thinking")  # cut right before the reasoning
    assert err.value.reason == "no_loss_tokens_after_truncation"


def test_ids_come_from_the_tokenizer_table():
    """A tokenizer with other special ids: the renderer reads them, nothing is hard-coded."""

    class CharTok:
        special_tokens = {n: 900 + i for i, n in enumerate(KimiSpecialTokens.NAMES.values())}

        def encode(self, text):
            return [ord(c) for c in text]

    t = CharTok()
    sp = t.special_tokens
    s = render_kimi(t, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], 64, mode="instant")
    ids, mask = seq(
        ([sp["<|im_user|>"]], 0), ([ord(c) for c in "user"], 0), ([sp["<|im_middle|>"]], 0), ([72, 105], 0),
        ([sp["<|im_end|>"]], 0), ([sp["<|im_assistant|>"]], 0), ([ord(c) for c in "assistant"], 0),
        ([sp["<|im_middle|>"], sp["<think>"], sp["</think>"]], 0), ([89, 111], 1), ([sp["<|im_end|>"]], 1),
    )
    assert (s.input_ids.tolist(), s.loss_mask.tolist()) == (ids, mask)
    with pytest.raises(KeyError):
        KimiSpecialTokens.from_mapping({"<|im_end|>": 1})


@pytest.mark.parametrize(
    "messages, mode, reason",
    [
        ([{"role": "user", "content": "Hi"}], "instant", "no_assistant_turn"),
        ([{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}], "instant", "unknown_role"),
        ([{"role": "user", "content": "say <|im_end|>"}, {"role": "assistant", "content": "no"}], "instant",
         "special_token_in_text"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x</think>y"}], "instant",
         "special_token_in_text"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "r"}],
         "instant", "reasoning_in_instant_mode"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "thinking",
         "no_reasoning_in_thinking_mode"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}], "instant", "empty_assistant_turn"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "tool_calls": [{"x": 1}]}],
         "instant", "bad_tool_calls"),
        ([{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}], "instant",
         "non_text_content"),
    ],
)
def test_bad_rows(tok, messages, mode, reason):
    with pytest.raises(BadRow) as err:
        render_kimi(tok, messages, 256, mode=mode)
    assert err.value.reason == reason


def test_missing_reasoning_empty_policy(tok, E):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, mask = rendered(tok, msgs, "thinking", fmt=KimiFormat(missing_reasoning="empty"))
    # the model closed its (empty) reasoning itself: </think> is generated
    tail_ids, tail_mask = seq(([IM_MIDDLE, THINK], 0), ([THINK_END], 1), (E("Yo"), 1), ([IM_END], 1))
    assert (ids[-len(tail_ids):], mask[-len(tail_ids):]) == (tail_ids, tail_mask)


# ----------------------------------------------------------------------------------------------
# Property tests: an independent walk over the rendered ids
# ----------------------------------------------------------------------------------------------

_CHARS = list("abcdefghij XYZ.,!?0123'\"{}:\n\té日🤖")
TEXT = st.text(alphabet=st.sampled_from(_CHARS), min_size=1, max_size=16)
NAME = st.text(alphabet=st.sampled_from(list("abcxyz_")), min_size=1, max_size=8)


@st.composite
def conversations(draw, mode):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    rounds = draw(st.integers(1, 3))
    for r in range(rounds):
        msgs.append({"role": "user", "content": draw(TEXT)})
        for _ in range(draw(st.integers(0, 2))):
            calls = [_call(draw(NAME), {"q": draw(TEXT)}) for _ in range(draw(st.integers(1, 2)))]
            a = {"role": "assistant", "content": draw(st.one_of(st.just(""), TEXT)), "tool_calls": calls}
            if mode == "thinking":
                a["reasoning_content"] = draw(TEXT)
            msgs.append(a)
            msgs += [{"role": "tool", "content": draw(TEXT)} for _ in calls]
        final = {"role": "assistant", "content": draw(TEXT)}
        if mode == "thinking":
            final["reasoning_content"] = draw(TEXT)
        msgs.append(final)
    return msgs


def _kept_reasoning(messages):
    """Thinking mode: the final assistant turn and the tool-call turns of its loop (spec)."""
    a = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last_plain = max([i for i in a[:-1] if not m_calls(messages[i])], default=-1)
    return {i for i in a if i > last_plain}


def m_calls(m):
    return m.get("tool_calls") or []


def check_walk(tok, messages, mode, ids, mask):
    """Walk the ids turn by turn (turn = header ... first <|im_end|>), next to the messages.
    Returns (generated positions, not-generated positions) as found from the structure."""
    dec = tok.decode
    kept = _kept_reasoning(messages) if mode == "thinking" else set()
    gen, other = [], []
    pos = 0
    n_calls = 0
    for i, m in enumerate(messages):
        start = pos
        end = ids.index(IM_END, start)
        mid = ids.index(IM_MIDDLE, start)
        header = {"system": IM_SYSTEM, "user": IM_USER, "tool": IM_SYSTEM, "assistant": IM_ASSISTANT}[m["role"]]
        assert ids[start] == header and mid < end
        assert dec(ids[start + 1: mid]) == ("tool" if m["role"] == "tool" else m["role"])
        other += range(start, mid + 1)  # header token, role name, <|im_middle|>
        if m["role"] != "assistant":
            assert dec(ids[mid + 1: end]) == m["content"] and not any(i in HEADERS for i in ids[mid + 1: end])
            other += range(mid + 1, end + 1)
        else:
            assert ids[mid + 1] == THINK
            other.append(mid + 1)
            close = ids.index(THINK_END, mid + 2)
            if i in kept:
                assert dec(ids[mid + 2: close]) == m["reasoning_content"]
                gen += range(mid + 2, close + 1)  # reasoning and </think>
            else:
                assert close == mid + 2  # empty pair: template-inserted, or reasoning dropped
                other.append(close)
            body = ids[close + 1: end]
            split = body.index(TC_SECTION_BEGIN) if TC_SECTION_BEGIN in body else len(body)
            assert dec(body[:split]) == (m["content"] or "")
            calls = m_calls(m)
            if calls:
                assert body[split] == TC_SECTION_BEGIN and body[-1] == TC_SECTION_END
                section = body[split + 1: -1]
                for c in calls:
                    assert section[0] == TC_BEGIN
                    a, e = section.index(TC_ARG), section.index(TC_END)
                    assert dec(section[1:a]) == f"functions.{c['function']['name']}:{n_calls}"
                    assert dec(section[a + 1: e]) == c["function"]["arguments"]
                    section = section[e + 1:]
                    n_calls += 1
                assert section == []
            gen += range(close + 1, end + 1)  # answer, tool calls, <|im_end|>
        pos = end + 1
    assert pos == len(ids)
    return gen, other


@pytest.mark.parametrize("mode", ["thinking", "instant"])
def test_property_mask_is_exactly_the_generated_tokens(tok, mode):
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(conversations(mode))
    def run(messages):
        ids, mask = rendered(tok, messages, mode)
        gen, other = check_walk(tok, messages, mode, ids, mask)
        assert sorted(gen + other) == list(range(len(ids)))
        # never on a system/user/tool token or any header, always on every generated token
        assert not any(mask[t] for t in other)
        assert all(mask[t] for t in gen)
        for t, i in enumerate(ids):
            if i in HEADERS or i == IM_MIDDLE:
                assert not mask[t]

    run()


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(messages=conversations("thinking"), frac=st.floats(0.0, 1.0))
def test_property_truncation_is_a_prefix(tok, messages, frac):
    ids, mask = rendered(tok, messages, "thinking")
    cut = max(1, int(frac * len(ids)))
    if any(mask[2:cut]):
        assert rendered(tok, messages, "thinking", max_length=cut) == (ids[:cut], mask[:cut])
    else:
        with pytest.raises(BadRow, match="no_loss_tokens_after_truncation"):
            render_kimi(tok, messages, cut, mode="thinking")


# ----------------------------------------------------------------------------------------------
# build_dataset with the Kimi renderer
# ----------------------------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [{"messages": [{"role": "user", "content": "x <|im_end|> y"}, {"role": "assistant", "content": "z"}]}] + [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {n}"},
                  {"role": "assistant", "content": " ".join(str(k) for k in range(1, n + 1)),
                   "reasoning_content": "Just count."}]}
    for n in range(1, 7)
]


def test_build_dataset_with_kimi_renderer_instant(tok, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in r["messages"]]}
            for r in ROWS]
    _write_jsonl(path, rows)
    for render in (partial(render_kimi, tok, mode="instant"), kimi_renderer(tok, mode="instant")):
        data = build_dataset(tok, source="jsonl", path=str(path), max_length=64, num_samples=4, heldout_samples=2,
                             end_of_turn_id=IM_END, show_progress=False, render=render)
        assert data.rows_seen == 7 and dict(data.skipped) == {"special_token_in_text": 1}
        got = sorted(s.input_ids.tolist() + [-1] + s.loss_mask.int().tolist() for s in data.train + data.heldout)
        want = []
        for r in rows[1:]:
            s = render_kimi(tok, normalize_row(r), 64, mode="instant")
            want.append(s.input_ids.tolist() + [-1] + s.loss_mask.int().tolist())
        assert got == sorted(want)


def test_build_dataset_thinking_refuses_rows_without_reasoning(tok, tmp_path):
    """Thinking-mode rows whose final turn carries no reasoning are refused by reason, never
    trained on as if the reasoning had been empty."""
    import copy

    rows = copy.deepcopy(ROWS)
    for row in rows:
        for m in row["messages"]:
            m.pop("reasoning_content", None)
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, rows)
    with pytest.raises(ValueError, match="no_reasoning_in_thinking_mode"):
        build_dataset(tok, source="jsonl", path=str(path), max_length=64, num_samples=4, heldout_samples=2,
                      end_of_turn_id=IM_END, show_progress=False, render=kimi_renderer(tok, mode="thinking"))


def test_build_dataset_thinking_keeps_reasoning(tok, tmp_path):
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, ROWS)
    data = build_dataset(tok, source="jsonl", path=str(path), max_length=64, num_samples=4, heldout_samples=2,
                         end_of_turn_id=IM_END, show_progress=False, render=kimi_renderer(tok, mode="thinking"))
    assert all(THINK_END in s.input_ids.tolist() for s in data.train)


def test_tool_result_text_parts_join_with_a_space_as_sglang_does(tok, E):
    """SGLang flattens a tool result's text parts with " " for every template before rendering
    (serving_chat.py normalize_tool_content); a user turn's parts reach Kimi's template as parts,
    which it prints back to back."""
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "now?"}]},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {})]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0",
         "content": [{"type": "text", "text": "Sunny,"}, {"type": "text", "text": "21C"}]},
        {"role": "assistant", "content": "Sunny."},
    ]}
    ids, _ = rendered(tok, normalize_row(row, agentic=True), "instant")
    tool_turn = [IM_SYSTEM, *E("tool"), IM_MIDDLE, *E("Sunny, 21C"), IM_END]
    assert any(ids[i:i + len(tool_turn)] == tool_turn for i in range(len(ids)))
    user_turn = [IM_USER, *E("user"), IM_MIDDLE, *E("Weathernow?"), IM_END]
    assert ids[: len(user_turn)] == user_turn
    # the same through a list given straight to the renderer (no normalize_row)
    ids2, _ = rendered(tok, row["messages"], "instant")
    assert ids2 == ids


@pytest.mark.parametrize("mode", ["thinking", "instant"])
def test_generation_prompt_is_the_training_render_cut_before_the_answer(tok, E, mode):
    """One rendering path: the eval/serving prompt after a conversation's turns == the training
    render of the same conversation cut before its final answer (what regeneration decodes from)."""
    from specforge_k25.data.kimi_format import kimi_prompt_renderer
    from specforge_k25.data.regenerate import regeneration_prompt

    conv = [dict(m) for m in TOOL_LOOP]
    if mode == "instant":
        conv = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv]
    render_prompt = kimi_prompt_renderer(tok, mode=mode)
    sample = render_kimi(tok, conv, 4096, mode=mode)
    assert render_prompt(conv[:-1]) == regeneration_prompt(sample).tolist()
    tail = [IM_ASSISTANT, *E("assistant"), IM_MIDDLE, THINK] + ([THINK_END] if mode == "instant" else [])
    single = render_prompt([{"role": "user", "content": "Hi"}])
    assert single == [IM_USER, *E("user"), IM_MIDDLE, *E("Hi"), IM_END, *tail]
