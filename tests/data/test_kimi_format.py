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
* tool results: `<|im_system|>{name or tool}<|im_middle|>## Return of {tool_call_id}\n{content}<|im_end|>`,
  never supervised.

Golden tests against Kimi-K2.5's own chat template (tests/fixtures/kimi_k25_chat_template.jinja,
rendered by transformers' chat-template renderer and encoded with special tokens parsed, as SGLang
does; docs/KIMI_K25.md §5.6): the renderer's ids == the template's ids for plain, system-less,
thinking, instant, tool-call, tool-result (with and without a name) and tool-declaration
conversations. The TypeScript tool declaration is checked against outputs of Moonshot's own
encoder (`tool_declaration_ts.py`).
"""
from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

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
    """An OpenAI-style call: its id is not of Kimi's form, so the renderer renumbers it."""
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


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
        ([IM_SYSTEM], 0), (E("tool"), 0), ([IM_MIDDLE], 0), (E("## Return of functions.get_weather:0\nSunny, 21C"), 0),
        ([IM_END], 0),
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

    def expected(idx, prefix_of=lambda cid: f"## Return of {cid}\n"):
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
    fmt = KimiFormat(tool_result_prefix="## Return of {tool_call_id}\n")  # the default, spelled out
    assert rendered(tok, msgs, "instant", fmt=fmt) == expected([0, 1, 2], lambda cid: f"## Return of {cid}\n")
    assert rendered(tok, msgs, "instant", fmt=KimiFormat(tool_result_prefix="")) == expected([0, 1, 2], lambda cid: "")
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
            body = (f"## Return of {m.get('tool_call_id', '')}\n" if m["role"] == "tool" else "") + m["content"]
            assert dec(ids[mid + 1: end]) == body and not any(i in HEADERS for i in ids[mid + 1: end])
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
                    # as served: SGLang parses the arguments, the template prints them with json.dumps
                    assert dec(section[a + 1: e]) == json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
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
    tool_turn = [IM_SYSTEM, *E("tool"), IM_MIDDLE, *E("## Return of functions.get_weather:0\nSunny, 21C"), IM_END]
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


# ----------------------------------------------------------------------------------------------
# The tool declaration (TypeScript style), against Moonshot's encoder
# ----------------------------------------------------------------------------------------------

def _fn(name, parameters=None, description=None):
    f = {"name": name}
    if description is not None:
        f["description"] = description
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


def _obj(properties, required=(), **kw):
    return {"type": "object", "properties": properties, "required": list(required), **kw}


_HEAD = "# Tools\n\n## functions\nnamespace functions {\n"

# Tools -> the text Moonshot's `tool_declaration_ts.encode_tools_to_typescript_style` (Kimi-K2.5's
# tokenizer folder) returned for them, as captured by lightseekorg/smg in
# crates/tokenizer/tests/fixtures/kimi_k25/{schemas,expected}/ (commit 65afd0dc5, "Python-generated
# reference outputs", regenerate.py); Apache-2.0.
MOONSHOT_TS = [
    ([_fn("echo", _obj({"text": {"type": "string"}}, ["text"]), "Echo a string back to the caller.")],
     _HEAD + "// Echo a string back to the caller.\ntype echo = (_: {\n  text: string\n}) => any;\n}\n"),
    ([_fn("delay", _obj({"ms": {"type": "integer", "minimum": 0}, "reason": {"type": "string"}}, ["ms"]),
          "Sleep for some milliseconds.")],
     _HEAD + "// Sleep for some milliseconds.\ntype delay = (_: {\n  // minimum: 0\n  ms: number,\n  reason?: string\n}) => any;\n}\n"),
    ([_fn("create_user", _obj({"user": _obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name"])}, ["user"]),
          "Create a new user record.")],
     _HEAD + "// Create a new user record.\ntype create_user = (_: {\n  user: {\n    name: string,\n    age?: number\n  }\n}) => any;\n}\n"),
    ([_fn("tag_items", _obj({"tags": {"type": "array", "items": {"type": "string"}}}, ["tags"]), "Apply tags.")],
     _HEAD + "// Apply tags.\ntype tag_items = (_: {\n  tags: Array<string>\n}) => any;\n}\n"),
    ([_fn("ping", {"type": "object", "properties": {}}), _fn("pong", {"type": "object", "properties": {}})],
     _HEAD + "type ping = (_: {}) => any;\ntype pong = (_: {}) => any;\n}\n"),
    ([_fn("set_status", _obj({"status": {"enum": ["active", "paused", "done"]}}, ["status"]))],
     _HEAD + 'type set_status = (_: {\n  status: "active" | "paused" | "done"\n}) => any;\n}\n'),
    ([_fn("set_value", _obj({"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, ["v"]))],
     _HEAD + "type set_value = (_: {\n  v: string | number\n}) => any;\n}\n"),
    ([_fn("store", _obj({"x": {"type": ["string", "null"]}}, ["x"]))],
     _HEAD + "type store = (_: {\n  x: string | null\n}) => any;\n}\n"),
    ([_fn("create_node", {"type": "object", "$defs": {"Node": _obj({"id": {"type": "string"}, "label": {"type": "string"}}, ["id"])},
                          "properties": {"node": {"$ref": "#/$defs/Node"}}, "required": ["node"]})],
     _HEAD + "interface Node {\n  id: string,\n  label?: string\n}\ntype create_node = (_: {\n  node: Node\n}) => any;\n}\n"),
    ([_fn("annotate", _obj({"text": {"type": "string", "description": "The text\nto annotate."}}, ["text"]),
          "Annotate the input.\nSupports multiple\nlines.")],
     _HEAD + "// Annotate the input.\n// Supports multiple\n// lines.\ntype annotate = (_: {\n  // The text\n  // to annotate.\n"
             "  text: string\n}) => any;\n}\n"),
    ([_fn("translate", _obj({"text": {"type": "string"}}, ["text"]), "翻译 text into 中文.")],
     _HEAD + "// 翻译 text into 中文.\ntype translate = (_: {\n  text: string\n}) => any;\n}\n"),
    ([_fn("noop", {"type": "object", "properties": {}})], _HEAD + "type noop = (_: {}) => any;\n}\n"),
    ([_fn("weird", _obj({"x": {"type": "uuid"}}, ["x"]))], _HEAD + "type weird = (_: {\n  x: uuid\n}) => any;\n}\n"),
]


@pytest.mark.parametrize("case", range(len(MOONSHOT_TS)))
def test_tool_declaration_is_moonshots_typescript(case):
    from specforge_k25.data.kimi_tools import kimi_tool_declaration

    tools, want = MOONSHOT_TS[case]
    assert kimi_tool_declaration(tools) == want


def test_tool_declaration_rules_read_from_moonshots_encoder():
    """Rules of `tool_declaration_ts.py` that the captured outputs above do not exercise, written
    out from its code: keys deep-sorted first (so $defs come out in name order), a field's comment
    lines (description, sorted constraints, default), required fields first, additionalProperties,
    an array item's comment lines, a self-referring schema (`#`)."""
    from specforge_k25.data.kimi_tools import kimi_tool_declaration

    params = {
        "type": "object", "additionalProperties": False, "required": ["b", "a"],
        "$defs": {"Z": {"type": "string", "description": "last"}, "A": _obj({"k": {"type": "boolean"}})},
        "properties": {
            "z": {"type": "string", "maxLength": 5, "minLength": 1, "description": "Z field", "default": "x"},
            "b": {"type": "array", "minItems": 1, "items": {"type": "integer", "description": "an id", "maximum": 9}},
            "a": {"$ref": "#/$defs/A"},
            "m": {"type": "object", "additionalProperties": {"type": "number"}, "default": 3},
            "e": {"enum": ["x", 1, None, True]},
        },
    }
    want = (_HEAD + "interface A {\n  k?: boolean\n}\n// last\ninterface Z string\n"
            "type f = (_: {\n"
            "  a: A,\n"
            "  // minItems: 1\n  b: Array<\n    // an id\n    // maximum: 9\n    number\n  >,\n"
            '  e?: "x" | 1 | None | True,\n'
            "  // Default: 3\n  m?: {\n    [k: string]: number\n  },\n"
            '  // Z field\n  // maxLength: 5, minLength: 1\n  // Default: "x"\n  z?: string,\n'
            "  [k: string]: never\n"
            "}) => any;\n}\n")
    assert kimi_tool_declaration([_fn("f", params)]) == want
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}, "name": {"type": "string"}},
            "required": ["name"]}
    assert kimi_tool_declaration([_fn("t", tree, "A tree.")]) == (
        _HEAD + "interface parameters {\n  kids?: Array<parameters>,\n  name: string\n}\n// A tree.\n"
                "type t = (_: parameters) => any;\n}\n")


@pytest.mark.parametrize("tools", [
    [_fn("f", _obj({"x": {"type": "string", "enum": [1, 2]}}))],  # enum values against the declared type
    [_fn("f", _obj({"x": {"$ref": "#/$defs/Missing"}}))],
    [_fn("f", _obj({"x": {"type": ["string", "date"]}}))],
    [_fn("f", _obj({"x": {"type": "object", "properties": {"y": 5}}}))],
    [_fn("f", _obj({}, additionalProperties="yes"))],
    [{"type": "web_search", "function": {"name": "s"}}],  # no function tool at all
])
def test_tools_moonshots_encoder_rejects_are_refused(tok, tools):
    """Where Kimi's tokenizer catches an encoder error and falls back to a JSON declaration,
    the row is refused (counted) rather than rendered."""
    from specforge_k25.data.kimi_tools import kimi_tool_declaration

    with pytest.raises(Exception):
        kimi_tool_declaration(tools)
    with pytest.raises(BadRow) as err:
        render_kimi(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], 256,
                    mode="instant", tools=tools)
    assert err.value.reason == "bad_tools"


# ----------------------------------------------------------------------------------------------
# Golden tests against Kimi-K2.5's own chat template
# ----------------------------------------------------------------------------------------------

TEMPLATE_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kimi_k25_chat_template.jinja"


@pytest.fixture(scope="module")
def template():
    return TEMPLATE_FIXTURE.read_text()


def served(messages):
    """What SGLang 0.5.23 hands Kimi's template for these messages (serving_chat.py,
    `_apply_jinja_template`): an absent content becomes "", None-valued keys are dropped, a tool
    result's text parts are joined with " ", an assistant call's string arguments are parsed
    (`normalize_assistant_tool_call_arguments`), a call without an id keeps `id: None` (its
    pydantic model's dump; the template prints "None"), and a user turn has no `name` (its
    pydantic model has none)."""
    out = []
    for m in copy.deepcopy(list(messages)):
        m = {k: v for k, v in m.items() if v is not None and k != "content_parts"}
        m.setdefault("content", "")
        if m["role"] == "user":
            m.pop("name", None)
        if m["role"] == "tool" and isinstance(m["content"], list):
            m["content"] = " ".join(p["text"] if isinstance(p, dict) else p for p in m["content"])
        for call in m.get("tool_calls") or []:
            call.setdefault("id", None)
            if isinstance(call["function"].get("arguments"), str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(m)
    return out


def template_ids(tok, template, messages, mode, add_generation_prompt, tools=None):
    """The template's text for `messages`, encoded as SGLang encodes it (special tokens parsed)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from specforge_k25.data.kimi_tools import kimi_tool_declaration

    kw = {"thinking": False} if mode == "instant" else {}
    if tools:  # Kimi's tokenizer passes `tools_ts_str` (its TypeScript text); checked above
        kw.update(tools=tools, tools_ts_str=kimi_tool_declaration(tools))
    text = render_jinja_template([served(messages)], chat_template=template,
                                 add_generation_prompt=add_generation_prompt, **kw)[0][0]
    return tok.encode(text, allowed_special="all")


def served_ids(tok, template, messages, mode, tools=None):
    """What the server sees when the model has generated the final assistant turn F: the template's
    generation prompt after the turns before F, then F as generated (reasoning, </think>, answer,
    tool calls, <|im_end|>). A tool-calling F is in the template's kept suffix, so the template
    writes it as generated; a plain F is written out here."""
    final = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    assert final == len(messages) - 1
    f = served(messages)[final]
    if f.get("tool_calls"):
        ids = template_ids(tok, template, messages, mode, False, tools)
        prompt = template_ids(tok, template, messages[:final], mode, True, tools)
        assert ids[: len(prompt)] == prompt
        return ids
    generated = (f.get("reasoning_content", "") + "</think>" if mode == "thinking" else "") + f["content"] + "<|im_end|>"
    return template_ids(tok, template, messages[:final], mode, True, tools) + tok.encode(generated, allowed_special="all")


def _weather_tool():
    return _fn("get_weather", _obj({"city": {"type": "string", "description": "City name"},
                                    "unit": {"enum": ["C", "F"]}}, ["city"]), "Current weather of a city.")


def _kcall(idx, name, args):
    return {"id": f"functions.{name}:{idx}", "type": "function", "function": {"name": name, "arguments": args}}


GOLDEN_TEMPLATE_CASES = {
    "plain": ([SYS, USER, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}], None),
    "system_less": ([USER, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}], None),
    "multi_turn": (TWO_TURNS, None),
    "tool_call_and_result": ([
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.",
         "tool_calls": [_kcall(0, "get_weather", '{"city":"Paris"}'), _kcall(1, "get_weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Sunny, 21C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": [{"type": "text", "text": "Rain,"},
                                                                             {"type": "text", "text": "9C"}]},
        {"role": "assistant", "content": "Paris sunny, Oslo rain.", "reasoning_content": "Both back."},
    ], None),
    "tool_loop_after_a_chat": ([
        {"role": "system", "content": "Use tools.", "name": "ops"},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Time in Tokyo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.",
         "tool_calls": [_kcall(0, "get_time", '{"tz": "Asia/Tokyo", "note": "日本"}')]},
        {"role": "tool", "tool_call_id": "functions.get_time:0", "name": "get_time", "content": "09:00"},
        {"role": "assistant", "content": "", "reasoning_content": "Again.",
         "tool_calls": [_kcall(1, "get_time", "{}")]},
    ], None),
    "tool_declaration": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need weather.",
         "tool_calls": [_kcall(0, "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done."},
    ], [_weather_tool(), _fn("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}})]),
}


def _instant(messages):
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


@pytest.mark.parametrize("mode", ["thinking", "instant"])
@pytest.mark.parametrize("name", list(GOLDEN_TEMPLATE_CASES))
def test_golden_ids_are_the_templates(tok, template, name, mode):
    """Renderer ids == Kimi-K2.5's template's ids, as the server sees the conversation when the
    model has answered it; instant mode also == the template applied to the whole conversation,
    and the generation prompt after every prefix == the template's generation prompt."""
    from specforge_k25.data.kimi_format import kimi_prompt_renderer

    messages, tools = GOLDEN_TEMPLATE_CASES[name]
    messages = messages if mode == "thinking" else _instant(messages)
    ids, _ = rendered(tok, messages, mode, tools=tools)
    assert ids == served_ids(tok, template, messages, mode, tools)
    if mode == "instant":
        assert ids == template_ids(tok, template, messages, mode, False, tools)
    render_prompt = kimi_prompt_renderer(tok, mode=mode)
    for cut in range(1, len(messages)):
        if messages[cut]["role"] == "assistant":
            prefix = messages[:cut] if not tools else _with_tools(messages[:cut], tools)
            assert render_prompt(prefix) == template_ids(tok, template, messages[:cut], mode, True, tools)


def _with_tools(messages, tools):
    from specforge_k25.data.sources import Conversation

    conv = Conversation(messages)
    conv.tools = tools
    return conv


def test_template_inserts_no_default_system_prompt(tok, template, E):
    """Kimi-K2.5's template starts a system-less conversation with its first turn (Kimi-K2-Instruct
    and K2-Thinking insert "You are Kimi, an AI assistant created by Moonshot AI."): the renderer's
    default is none, and `default_system` reproduces the older templates' turn."""
    ids = template_ids(tok, template, [USER], "thinking", True)
    assert ids[0] == IM_USER
    assert kimi_prompt_renderer_ids(tok, [USER]) == ids
    k2 = "You are Kimi, an AI assistant created by Moonshot AI."
    with_default = kimi_prompt_renderer_ids(tok, [USER], fmt=KimiFormat(default_system=k2))
    assert with_default == [IM_SYSTEM, *E("system"), IM_MIDDLE, *E(k2), IM_END] + ids
    assert kimi_prompt_renderer_ids(tok, [SYS, USER], fmt=KimiFormat(default_system=k2)) == \
        template_ids(tok, template, [SYS, USER], "thinking", True)


def kimi_prompt_renderer_ids(tok, messages, fmt=None):
    from specforge_k25.data.kimi_format import kimi_prompt_renderer

    return kimi_prompt_renderer(tok, mode="thinking", fmt=fmt or KimiFormat())(messages)


def test_tool_call_ids_and_arguments_as_served(tok, template, E):
    """Ids as the data gives them (`tool_call_ids="verbatim"`) == the template's; by default an id
    not of Kimi's form is renumbered and its result's "## Return of" line follows. Arguments are
    served re-printed (`{"a":1}` -> `{"a": 1}`); `tool_arguments="verbatim"` keeps the string."""
    messages = [
        {"role": "user", "content": "Add 2+3."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"x":2,"y":3}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "5"},
        {"role": "assistant", "content": "5."},
    ]
    verbatim, _ = rendered(tok, messages, "instant", fmt=KimiFormat(tool_call_ids="verbatim"))
    assert verbatim == template_ids(tok, template, messages, "instant", False)
    ids, _ = rendered(tok, messages, "instant")
    text = tok.decode(ids)
    assert "<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.add:0\n5" in text and "call_7" not in text
    assert '{"x": 2, "y": 3}' in text
    raw, _ = rendered(tok, messages, "instant", fmt=KimiFormat(tool_arguments="verbatim"))
    assert '{"x":2,"y":3}' in tok.decode(raw)
    bad = copy.deepcopy(messages)
    bad[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"  # SGLang refuses a non-object
    with pytest.raises(BadRow, match="bad_tool_calls"):
        render_kimi(tok, bad, 256, mode="instant")


# ----------------------------------------------------------------------------------------------
# A row's tools: normalize_row -> the renderer, build_dataset, the config
# ----------------------------------------------------------------------------------------------


def test_normalize_row_carries_tools_for_the_kimi_renderer(tok, E):
    from specforge_k25.data.kimi_tools import kimi_tool_declaration

    tool = _weather_tool()
    base = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    for given in ([tool], json.dumps([tool]), [tool["function"]]):  # list, JSON text, bare function specs
        conv = normalize_row({**base, "tools": given}, agentic=True)
        assert conv == base["messages"] and conv.tools == [tool]
        ids, mask = rendered(tok, conv, "instant")
        declare = [IM_SYSTEM, *E("tool_declare"), IM_MIDDLE, *E(kimi_tool_declaration([tool])), IM_END]
        assert ids[: len(declare)] == declare and not any(mask[: len(declare)])
        assert ids[len(declare):] == rendered(tok, base["messages"], "instant")[0]
        assert rendered(tok, conv, "instant", fmt=KimiFormat(declare_tools=False))[0] == ids[len(declare):]
    for none in (None, [], ""):
        assert normalize_row({**base, "tools": none}, agentic=True).tools is None
    assert normalize_row({**base, "tools": [tool]}) == base["messages"]  # the template path: untouched
    assert type(normalize_row({**base, "tools": [tool]})) is list
    for bad in ("{not json", {"a": 1}, [1], [{"type": "function", "function": {"description": "no name"}}],
                [{"type": "retrieval"}]):
        with pytest.raises(BadRow, match="bad_tools"):
            normalize_row({**base, "tools": bad}, agentic=True)


def test_build_dataset_counts_rows_with_bad_tools(tok, tmp_path):
    rows = [dict(ROWS[1], tools="oops")] + [dict(r, tools=[_weather_tool()]) for r in ROWS[1:]]
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, rows)
    data = build_dataset(tok, source="jsonl", path=str(path), max_length=512, num_samples=4, heldout_samples=2,
                         end_of_turn_id=IM_END, show_progress=False, render=kimi_renderer(tok, mode="thinking"))
    assert dict(data.skipped) == {"bad_tools": 1}
    assert all(tok.decode(s.input_ids.tolist()).startswith("<|im_system|>tool_declare<|im_middle|># Tools\n")
               for s in data.train + data.heldout)


def test_target_config_kimi_options_reach_the_renderer(tok, E):
    from specforge_k25.config import compose_job
    from specforge_k25.data.kimi_format import kimi_format_of
    from specforge_k25.setup.run import _renderer, prompt_renderer

    job = compose_job(["target=kimi_k25"])
    assert kimi_format_of(job.target) == KimiFormat()  # the yaml spells out the defaults
    job = compose_job(["target=kimi_k25", "target.chat_mode=instant", "target.kimi.default_system='Be Kimi.'",
                       "target.kimi.tool_call_ids=verbatim", "target.kimi.tool_call_index=per_message",
                       "target.kimi.tool_arguments=verbatim", "target.kimi.keep_reasoning=final",
                       "target.kimi.supervise_history=false", "target.kimi.missing_reasoning=empty",
                       "target.kimi.declare_tools=false", "target.kimi.add_bos=true"])
    fmt = kimi_format_of(job.target)
    assert fmt == KimiFormat(default_system="Be Kimi.", tool_call_ids="verbatim", tool_call_index="per_message",
                             tool_arguments="verbatim", keep_reasoning="final", supervise_history=False,
                             missing_reasoning="empty", declare_tools=False, add_bos=True)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert _renderer(job.target, tok)(msgs, 64).input_ids.tolist() == render_kimi(tok, msgs, 64, mode="instant", fmt=fmt).input_ids.tolist()
    assert prompt_renderer(job.target, tok)(msgs[:1])[:2] == [BOS, IM_SYSTEM]
    with pytest.raises(ValueError, match="tool_call_ids"):
        kimi_format_of(compose_job(["target=kimi_k25", "target.kimi.tool_call_ids=openai"]).target)
