"""`fit_turns` on a row with tool declarations: a long row kept as a suffix of its turns keeps the
row's `tools`, so the shortened sample is what the server renders for that shorter conversation
with the same tools (its tool_declare turn first); a row whose declaration alone fills max_length
is skipped by reason, never trained on without its tools."""
from __future__ import annotations

import json

from test_kimi_format import (  # its folder is on sys.path (pytest's default prepend import mode)
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    _fn,
    _obj,
    _weather_tool,
    served_ids,
    template,  # noqa: F401  (fixture)
    tok,  # noqa: F401  (fixture)
)

from specforge_k25.data.dataset import build_dataset, fit_turns
from specforge_k25.data.kimi_format import kimi_renderer, render_kimi
from specforge_k25.data.kimi_tools import kimi_tool_declaration
from specforge_k25.data.sources import normalize_row

TOOLS = [_weather_tool()]
MAX_LENGTH = 220


def _long_row(tools=TOOLS):
    """System, then four exchanges: long questions, short answers, the last answer longest, so the
    best fit of MAX_LENGTH tokens is the system turn + the last exchange (+ the declaration)."""
    messages = [{"role": "system", "content": "Use tools."}]
    for k in range(4):
        messages += [{"role": "user", "content": f"Question {k}: " + "what is the weather like " * 12},
                     {"role": "assistant", "content": f"Fine {k}." + (" It is sunny in Paris." * 4 if k == 3 else "")}]
    return {"messages": messages, "tools": tools}


def test_long_row_kept_as_later_turns_keeps_its_tools(tok, template):
    conv = normalize_row(_long_row(), agentic=True)
    render = kimi_renderer(tok, mode="instant")
    assert len(render(conv, 10 * MAX_LENGTH).input_ids) > MAX_LENGTH  # the whole row does not fit
    sample, dropped = fit_turns(render, conv, MAX_LENGTH)
    assert dropped
    shortened = conv[:1] + conv[7:]  # system + the last exchange
    want = render_kimi(tok, shortened, MAX_LENGTH, mode="instant", tools=TOOLS)
    assert not want.truncated
    assert sample.input_ids.tolist() == want.input_ids.tolist()
    assert sample.loss_mask.tolist() == want.loss_mask.tolist()
    declare = [IM_SYSTEM, *tok.encode_ordinary("tool_declare"), IM_MIDDLE,
               *tok.encode_ordinary(kimi_tool_declaration(TOOLS)), IM_END]
    assert sample.input_ids.tolist()[:len(declare)] == declare
    # ... and it is what Kimi-K2.5's template renders for that conversation with the same tools
    assert sample.input_ids.tolist() == served_ids(tok, template, shortened, "instant", TOOLS)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_build_dataset_long_row_with_tools(tok, tmp_path):
    """Through `build_dataset` (rows read from JSONL, `normalize_row`, `fit_turns`): the long row
    is one sample, the shortened conversation with its tools; a row whose declaration cannot fit
    at all is skipped with a counted reason."""
    huge = [_fn("get_weather", _obj({"city": {"type": "string"}}, ["city"]), "Weather. " * 200)]
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, [_long_row(), _long_row(huge), short, short])
    data = build_dataset(tok, source="jsonl", path=str(path), max_length=MAX_LENGTH, num_samples=3,
                         heldout_samples=0, end_of_turn_id=IM_END, show_progress=False,
                         render=kimi_renderer(tok, mode="instant"))
    assert data.rows_seen == 4 and dict(data.skipped) == {"no_loss_tokens_after_truncation": 1}
    assert data.turns_dropped == 1
    conv = normalize_row(_long_row(), agentic=True)
    want = render_kimi(tok, conv[:1] + conv[7:], MAX_LENGTH, mode="instant", tools=TOOLS).input_ids.tolist()
    assert want in [s.input_ids.tolist() for s in data.train]
