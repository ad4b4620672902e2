"""The TypeScript-style text of Kimi-K2.5's tool_declare turn (the Kimi renderer's `tools`).

Kimi-K2.5's tokenizer (`tokenization_kimi.py`, `apply_chat_template`) sorts the tools' keys
recursively, writes them with `tool_declaration_ts.encode_tools_to_typescript_style` and hands
the text to the template as `tools_ts_str`; when that raises, the template prints the tools as
compact JSON instead. What follows is written from that behaviour (docs/KIMI_K25.md §5.6),
checked against outputs of Moonshot's encoder in tests/data/test_kimi_format.py. Any schema the
encoder would reject raises here; the renderer then refuses the row (`bad_tools`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_TS_INDENT = "  "
_TS_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                   "integer": ("maximum", "minimum")}
_TS_TYPE_LIST = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                 "null": "null", "object": "{}", "array": "Array<any>"}


@dataclass
class _TsNode:
    """One parsed JSON schema. kind: scalar | object | array | enum | any_of | union | ref."""

    kind: str
    description: Any = ""
    constraints: dict | None = None
    name: Any = None  # scalar: type name; ref: referenced name
    items: Any = None  # array: item node; enum: the values; any_of: nodes; union: type names
    fields: list | None = None  # object: [(name, node, optional, default)]
    extra: Any = None  # object: additionalProperties (None, a bool, a node or anything else)


@dataclass
class _TsDefs:
    """The `$defs` met while parsing one function, and whether it refers to itself (`#`)."""

    definitions: dict
    self_ref: bool = False


def _ts_comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _ts_object(schema: dict, defs: _TsDefs) -> _TsNode:
    node = _TsNode("object", description=schema.get("description", ""), fields=[])
    if not schema:
        return node
    if "$defs" in schema and schema["$defs"]:
        defs.definitions.update(schema["$defs"].items())
    extra = schema.get("additionalProperties")
    node.extra = _ts_parse(extra, defs) if isinstance(extra, dict) else extra
    if "properties" in schema:
        props = schema["properties"]
        optional = set(props.keys()) - set(schema.get("required", []))
        node.fields = [(key, _ts_parse(prop, defs), key in optional, prop.get("default") if isinstance(prop, dict) else None)
                       for key, prop in props.items()]
    return node


def _ts_enum(schema: dict) -> _TsNode:
    values = schema["enum"]
    if "type" in schema:
        declared = schema["type"]
        if isinstance(declared, list):
            if len(declared) == 1:
                declared = declared[0]
            elif len(declared) == 2 and "null" in declared:
                declared = declared[1] if declared[0] == "null" else declared[0]
            else:
                raise ValueError(f"enum type {declared} is not supported")
        fits = {"string": lambda v: isinstance(v, str), "number": lambda v: isinstance(v, (int, float)),
                "integer": lambda v: isinstance(v, int), "boolean": lambda v: isinstance(v, bool)}
        for value in values:
            if value is not None and not fits.get(declared if isinstance(declared, str) else None, lambda v: True)(value):
                raise ValueError(f"enum value {value!r} is not a {declared}")
    return _TsNode("enum", description=schema.get("description", ""), items=values)


def _ts_parse(schema: Any, defs: _TsDefs) -> _TsNode:
    if isinstance(schema, bool):  # true: anything; false: written as null
        return _TsNode("scalar", name="any" if schema else "null")
    if not isinstance(schema, dict):
        raise ValueError(f"invalid JSON schema {schema!r}")
    description = schema.get("description", "")
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref == "#":
            defs.self_ref = True
            return _TsNode("ref", description=description, name="parameters")
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported reference {ref}")
        target = defs.definitions.get(ref.split("/")[-1])
        if target is None:
            raise ValueError(f"reference not found: {ref}")
        if not isinstance(target, dict):
            raise ValueError(f"invalid definition {target!r}")
        name = "parameters" if target.get("$self_ref", False) else ref.split("/")[-1]
        return _TsNode("ref", description=description, name=name)
    if "anyOf" in schema:
        return _TsNode("any_of", description=description, items=[_ts_parse(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return _ts_enum(schema)
    if "type" not in schema:
        if schema == {}:
            return _TsNode("scalar", name="any")
        raise ValueError(f"invalid JSON schema {schema!r}")
    declared = schema["type"]
    if isinstance(declared, list):
        return _TsNode("union", description=description, items=[_TS_TYPE_LIST[name] for name in declared])
    if declared == "object":
        return _ts_object(schema, defs)
    if declared == "array":
        item = _ts_parse(schema["items"], defs) if schema.get("items") else _TsNode("scalar", name="any")
        return _TsNode("array", description=description, items=item,
                       constraints={k: v for k, v in schema.items() if k in ("minItems", "maxItems")})
    keys = _TS_CONSTRAINTS.get(declared, ()) if isinstance(declared, str) else ()
    return _TsNode("scalar", description=description, name=declared,
                   constraints={k: v for k, v in schema.items() if k in keys})


def _ts_doc(node: _TsNode, indent: str) -> str:
    """The comment lines above a field or an array item (description, then constraints)."""
    lines = []
    if node.description:
        lines.append(_ts_comment(node.description, indent))
    if node.constraints:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(node.constraints.items(), key=lambda kv: kv[0])))
    return "".join(line + "\n" for line in lines)


def _ts_field(key: str, node: _TsNode, optional: bool, default: Any, indent: str) -> str:
    text = _ts_doc(node, indent)
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{key}{'?' if optional else ''}: {_ts_type(node, indent)}"


def _ts_type(node: _TsNode, indent: str = "") -> Any:
    if node.kind == "scalar":
        return "number" if node.name == "integer" else node.name
    if node.kind == "ref":
        return node.name
    if node.kind == "union":
        return " | ".join(node.items)
    if node.kind == "any_of":
        return " | ".join([_ts_type(n, indent) for n in node.items])
    if node.kind == "enum":
        return " | ".join([f'"{v}"' if isinstance(v, str) else str(v) for v in node.items])
    if node.kind == "array":
        inner = indent + _TS_INDENT
        doc = _ts_doc(node.items, inner)
        if not doc:
            return f"Array<{_ts_type(node.items, indent)}>"
        return "Array<\n" + doc + inner + _ts_type(node.items, inner) + "\n" + indent + ">"
    # object: required fields by name, then optional ones by name, then additionalProperties
    inner = indent + _TS_INDENT
    ordered = sorted((f for f in node.fields if not f[2]), key=lambda f: f[0])
    ordered += sorted((f for f in node.fields if f[2]), key=lambda f: f[0])
    parts = [_ts_field(*f, inner) for f in ordered]
    if node.extra is not None:
        if node.extra is True:
            extra = "any"
        elif node.extra is False:
            extra = "never"
        elif isinstance(node.extra, _TsNode):
            extra = _ts_type(node.extra, inner)
        else:
            raise ValueError(f"unknown additionalProperties: {node.extra!r}")
        parts.append(f"{inner}[k: string]: {extra}")
    if not parts:
        return "{}"
    return "{\n" + ",\n".join(parts) + "\n" + indent + "}"


def _ts_function(function: dict) -> str:
    defs = _TsDefs({})
    params = _ts_object(function.get("parameters") or {}, defs)
    blocks = []
    named = defs.self_ref  # the parameters refer to themselves (`#`): an interface, fields in their given order
    if named:
        body = ",\n".join(_ts_field(*f, _TS_INDENT) for f in params.fields)
        blocks.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in dict(defs.definitions).items():  # (a `#` met only in here changes nothing above)
        body = _ts_type(_ts_parse(schema, defs))
        about = schema.get("description", "")
        blocks.append((_ts_comment(about) + "\n" if about else "") + f"interface {name} {body}")
    signature = "parameters" if named else _ts_type(params)
    description = function.get("description")
    return "\n".join(filter(None, ["\n".join(blocks), (description and _ts_comment(description)) or "",
                                    f"type {function.get('name', 'function')} = (_: {signature}) => any;"]))


def _deep_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_deep_sorted(v) for v in value]
    return value


def kimi_tool_declaration(tools: Sequence[dict]) -> str:
    """The text of Kimi-K2.5's tool_declare turn for OpenAI-style `tools`
    (`[{"type": "function", "function": {"name", "description", "parameters"}}]`).
    Raises ValueError (or another exception) where Kimi's tokenizer would fall back to JSON."""
    functions = [_ts_function(tool["function"]) for tool in _deep_sorted(list(tools))
                 if tool.get("type") == "function" and tool.get("function")]
    if not functions:
        raise ValueError("no function tools to declare")
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
