"""Kimi rows as the server renders them: rows where the renderer differed from Kimi-K2.5's chat
template as SGLang 0.5.23 applies it (tests/fixtures/kimi_k25_chat_template.jinja, through the
`served` / `template_ids` / `served_ids` references of test_kimi_format.py). The rule: the training
render equals what the server sees for the conversation, or the row is skipped with a counted
reason (docs/KIMI_K25.md §5).

* a `developer` turn: SGLang passes the role through, the template prints `developer`;
* a `name` on the final assistant turn: the server generates it after its generation prompt,
  `<|im_assistant|>assistant<|im_middle|>`, so that is its header (earlier turns keep theirs);
* a tool call without an id: the server prints `None`; skipped (`tool_call_without_id`) unless
  `tool_call_ids="verbatim"`, which renders the `None`;
* an empty or null system turn and a null tool result: accepted, rendered with an empty body;
* the final turn's string tool-call arguments: as generated (SGLang returns them so), while an
  earlier turn's are re-printed by the template's `tojson`.
"""
from __future__ import annotations

import copy

import pytest

from specforge_k25.data.dataset import build_dataset
from specforge_k25.data.kimi_format import KimiFormat, kimi_prompt_renderer, kimi_renderer, render_kimi
from specforge_k25.data.regenerate import regeneration_prompt
from specforge_k25.data.sources import BadRow, normalize_row

from test_kimi_format import (  # noqa: F401  (fixtures: tok, E, template)
    E,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    USER,
    _kcall,
    _write_jsonl,
    rendered,
    served_ids,
    template,
    template_ids,
    tok,
)

MODES = ["thinking", "instant"]


def _reply(mode, content, **kw):
    """An assistant turn of `mode` (thinking mode carries reasoning)."""
    turn = {"role": "assistant", "content": content, **kw}
    return {**turn, "reasoning_content": "Think."} if mode == "thinking" else turn


def _contains(ids, part):
    return any(ids[i: i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.parametrize("mode", MODES)
def test_developer_turn_is_printed_as_the_template_prints_it(tok, template, E, mode):
    row = {"messages": [{"role": "developer", "content": "Answer in French."},
                        {"role": "developer", "content": "Be brief.", "name": "ops"},
                        {"role": "user", "content": "Hello"}, _reply(mode, "Bonjour")]}
    messages = normalize_row(row, agentic=True)
    assert [m["role"] for m in messages[:2]] == ["developer", "developer"]
    ids, _ = rendered(tok, messages, mode)
    assert ids == served_ids(tok, template, messages, mode)
    first = [IM_SYSTEM, *E("developer"), IM_MIDDLE, *E("Answer in French."), IM_END]
    assert ids[: len(first)] == first
    assert _contains(ids, [IM_SYSTEM, *E("ops"), IM_MIDDLE, *E("Be brief."), IM_END])
    assert kimi_prompt_renderer(tok, mode=mode)(messages[:-1]) == template_ids(tok, template, messages[:-1], mode, True)
    assert normalize_row(row)[0]["role"] == "system"  # the chat-template path: as before


@pytest.mark.parametrize("mode", MODES)
def test_final_turn_header_is_the_generation_prompts(tok, template, E, mode):
    """A `name` on the final turn: the server generated that turn after `<|im_assistant|>assistant
    <|im_middle|>`, the header training must show; an earlier turn's name is what the template
    prints in that prompt. The regeneration prompt cut from the sample is the server's too."""
    plain = [USER, _reply(mode, "Hello!", name="kimi"), {"role": "user", "content": "Bye"},
             _reply(mode, "Goodbye!", name="kimi")]
    calling = [USER, _reply(mode, "", name="kimi", tool_calls=[_kcall(0, "get_time", {"tz": "UTC"})])]
    for messages in (plain, calling):
        unnamed = messages[:-1] + [{k: v for k, v in messages[-1].items() if k != "name"}]
        sample = render_kimi(tok, messages, 4096, mode=mode)
        ids = sample.input_ids.tolist()
        assert ids == served_ids(tok, template, unnamed, mode)  # the generation prompt, then F as generated
        last = max(p for p, t in enumerate(ids) if t == IM_ASSISTANT)
        assert ids[last: last + 2 + len(E("assistant"))] == [IM_ASSISTANT, *E("assistant"), IM_MIDDLE]
        prompt = template_ids(tok, template, messages[:-1], mode, True)
        assert regeneration_prompt(sample).tolist() == prompt
    assert _contains(rendered(tok, plain, mode)[0], [IM_ASSISTANT, *E("kimi"), IM_MIDDLE])


def test_tool_call_without_id_is_skipped_or_printed_as_the_server_does(tok, template, tmp_path):
    row = {"messages": [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "content": "09:00"},
        {"role": "assistant", "content": "Nine."},
    ]}
    messages = normalize_row(row, agentic=True)
    with pytest.raises(BadRow, match="tool_call_without_id"):
        render_kimi(tok, messages, 256, mode="instant")
    verbatim, _ = rendered(tok, messages, "instant", fmt=KimiFormat(tool_call_ids="verbatim"))
    assert verbatim == template_ids(tok, template, messages, "instant", False)
    assert "<|tool_call_begin|>None<|tool_call_argument_begin|>" in tok.decode(verbatim)
    good = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello."}]}
            for i in range(3)]
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, [row] + good)
    data = build_dataset(tok, source="jsonl", path=str(path), max_length=256, num_samples=3, heldout_samples=0,
                         end_of_turn_id=IM_END, show_progress=False, render=kimi_renderer(tok, mode="instant"))
    assert dict(data.skipped) == {"tool_call_without_id": 1} and len(data.train) == 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("system", ["", "  ", None])
def test_rows_the_server_accepts_empty_system_and_null_tool_result(tok, template, mode, system):
    row = {"messages": [
        {"role": "system", "content": system},
        USER,
        _reply(mode, "", tool_calls=[_kcall(0, "get_time", {"tz": "UTC"})]),
        {"role": "tool", "tool_call_id": "functions.get_time:0", "content": None},
        _reply(mode, "No answer from the clock."),
    ]}
    messages = normalize_row(row, agentic=True)
    ids, _ = rendered(tok, messages, mode)
    assert ids == served_ids(tok, template, messages, mode)
    with pytest.raises(BadRow):  # the chat-template path: as before
        normalize_row(row)


@pytest.mark.parametrize("mode", MODES)
def test_final_turn_tool_arguments_are_as_generated(tok, template, mode):
    """SGLang returns a generated call's arguments as the model wrote them, so the final turn's
    string is rendered as given; an earlier turn's are what the template prints in the prompt."""
    messages = [
        USER,
        _reply(mode, "", tool_calls=[_kcall(0, "get_time", '{"tz":"UTC"}')]),
        {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "09:00"},
        _reply(mode, "", tool_calls=[_kcall(1, "get_time", '{"tz":"Asia/Tokyo"}')]),
    ]
    ids, _ = rendered(tok, messages, mode)
    generated = (("Think.</think>" if mode == "thinking" else "")
                 + "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
                 + '{"tz":"Asia/Tokyo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    prompt = template_ids(tok, template, messages[:-1], mode, True)
    assert ids == prompt + tok.encode(generated, allowed_special="all")
    assert '{"tz": "UTC"}' in tok.decode(prompt)
    # "verbatim" keeps every string; a final string that is not a JSON object is still refused
    assert '{"tz":"UTC"}' in tok.decode(rendered(tok, messages, mode, fmt=KimiFormat(tool_arguments="verbatim"))[0])
    bad = copy.deepcopy(messages)
    bad[-1]["tool_calls"][0]["function"]["arguments"] = "[1]"
    with pytest.raises(BadRow, match="bad_tool_calls"):
        render_kimi(tok, bad, 4096, mode=mode)
