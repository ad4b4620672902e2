"""Publishing a serving folder: written beside its place, checked, then swapped in, so that a
server or a reader never sees half a folder (each method's export builds what goes in it)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..paths import write_atomic, write_text_atomic


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point tensors of `tensors` that hold a NaN or an inf."""
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def publish_folder(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                   validate: Callable[[Path], None]) -> Path:
    """<out_dir>/{config.json, model.safetensors}, built in <out_dir>.tmp, `validate`d, then swapped
    in (the previous export aside as <out_dir>.old until the new one is in place); a folder that
    fails validation or a write is removed and the error raised. Tensors holding NaN or inf are
    refused before anything is written. The temporaries it clears are its own: a training run
    publishes inside its run folder, whose lock it holds (train/run_lock.py)."""
    bad = nonfinite_names(tensors)
    if bad:
        raise ValueError(f"not exported to {out_dir}: {len(bad)} of {len(tensors)} tensors hold NaN or inf "
                         f"({', '.join(bad[:4])})")
    out = Path(out_dir)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    if old.is_dir() and not out.exists():  # a publish died between its two renames: the old export is whole
        os.replace(old, out)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # the umask's mode: a server running as another user reads the folder (save_file alone makes 0600)
        write_atomic(tmp / "model.safetensors", lambda f: save_file(tensors, f, metadata={"format": "pt"}))
        write_text_atomic(tmp / "config.json", json.dumps(config, indent=2))
        validate(tmp)
    except BaseException:  # a failed check or write (a full disk): no partial folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # the old folder moved aside whole, the new one renamed in, then the old removed: a reader or a
    # crash never meets a half-deleted export (removing it in place first would)
    if out.exists():
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def shape_problems(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], skip=(), why_unexpected=None) -> list[str]:
    """Each tensor of `expected` missing or of another shape, and each tensor beyond it (those in
    `skip` aside: checked elsewhere), with `why_unexpected(name)` saying why that matters."""
    problems = []
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in sorted(set(tensors) - set(expected) - set(skip)):
        problems.append(f"unexpected tensor {name}" + (f" ({why_unexpected(name)})" if why_unexpected else ""))
    return problems
