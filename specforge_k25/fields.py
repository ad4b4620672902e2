"""Config fields with their one-line help and bounds: the typed config (config.py) and every draft
method's own config (draft/<method>/config.py) are built from these, so `--help` and the bound
checks read one kind of field."""
from __future__ import annotations

from dataclasses import field, fields, is_dataclass


def doc(default, help: str, at_least=None, above=None, **kw):
    """A field with its one-line help; `at_least` / `above`: the smallest value a size, count,
    interval or timeout may take (inclusive / exclusive; null stays allowed where the type is
    Optional), checked when the config is composed (`check_limits`)."""
    meta = {"help": help, **({"at_least": at_least} if at_least is not None else {}),
            **({"above": above} if above is not None else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def limit_problems(cfg, prefix: str = "") -> list[str]:
    """Every field of `cfg` (nested configs included) below its `at_least` / `above`, named as
    an override (`train.stream_slots must be >= 1 (got 0)`)."""
    problems = []
    for f in fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if is_dataclass(value):
            problems += limit_problems(value, name + ".")
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "at_least" in f.metadata and value < f.metadata["at_least"]:
            problems.append(f"{name} must be >= {f.metadata['at_least']} (got {value!r}): {f.metadata['help']}")
        if "above" in f.metadata and not value > f.metadata["above"]:
            problems.append(f"{name} must be > {f.metadata['above']} (got {value!r}): {f.metadata['help']}")
    return problems


def check_limits(cfg) -> None:
    """Refuse a zero or negative size, count, interval or timeout before any process starts (one
    would otherwise divide by zero, hang or fail mid-run), naming each field."""
    problems = limit_problems(cfg)
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))


def field_lines(cls, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """One line per field of the dataclass `cls` (nested ones expanded; those named in `skip`
    left out): `prefix.name (default) - help`."""
    lines = []
    for f in fields(cls):
        if f.name in skip:
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            lines += field_lines(type(default), prefix + f.name + ".")
        else:
            lines.append(f"  {prefix + f.name:<30} {str(default):<14} {f.metadata.get('help', '')}")
    return lines
