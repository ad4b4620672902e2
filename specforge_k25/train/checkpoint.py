"""Atomic checkpoints: safetensors for tensors, JSON for the rest (no pickle).

Layout: <run>/checkpoints/step_00000042/{draft.safetensors, optimizer.safetensors, state.json,
manifest.json}. A checkpoint is written into a temporary sibling folder and renamed into place only
when complete, so a crash mid-save leaves the previous checkpoint intact; a save that fails (a full
disk) removes its temporary folder. Each file's size and hash are in its manifest (train/manifest.py),
checked before a resume (`pick_checkpoint`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..paths import write_atomic, write_text_atomic
from .finite import check_finite
from .manifest import manifest_problems, write_manifest

PREFIX = "step_"


class WriteFailed(RuntimeError):
    """A checkpoint or the export could not be written (a full disk, a permission, a vanished folder)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict (parameters keyed by index, or by name from a sharded run) as
    safetensors entries `state.<param>.<name>` plus the JSON part."""
    tensors = {}
    for pid, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"state.{pid}.{name}"] = torch.as_tensor(value).detach().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


# How an optimizer runs, not what it learned: a resume keeps the resuming optimizer's own (its
# layout or optimizer_device may differ from the saving run's), torch's load_state_dict would not.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def optimizer_state_for(optim: dict, optimizer, names: list[str], by_name: bool) -> dict:
    """A checkpoint's optimizer state in the form `optimizer` loads: keyed by parameter name (a
    draft sharded with FSDP2 saves and loads the full state that way) or by index into the
    trainable parameters (torch's own form). Each run saves its own form, so a resume on another
    number of ranks or layout converts. `names`: the trainable parameters' names in optimizer order."""
    index = {name: i for i, name in enumerate(names)}

    def key(k):
        if by_name:
            return names[k] if isinstance(k, int) else k
        if isinstance(k, str) and k not in index:
            raise ValueError(f"the checkpoint's optimizer state names {k!r}, not a trainable parameter of the draft")
        return index[k] if isinstance(k, str) else k

    live = optimizer.param_groups
    if len(live) != len(optim["param_groups"]):
        raise ValueError(f"the checkpoint has {len(optim['param_groups'])} optimizer parameter group(s), "
                         f"the optimizer {len(live)}")
    groups = [{**g, "params": [key(p) for p in g["params"]], **{k: now[k] for k in _IMPLEMENTATION if k in now}}
              for g, now in zip(optim["param_groups"], live)]
    return {"state": {key(k): v for k, v in optim["state"].items()}, "param_groups": groups}


def save_checkpoint(run_dir: Path, step: int, draft_tensors: dict, optimizer_state: dict, scheduler_state: dict,
                    extra: dict, keep: int = 2) -> Path:
    """draft_tensors: the draft's state dict (its frozen embedding is left out); the state dicts of the
    optimizer and the LR schedule."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    draft = {k: v.detach().contiguous() for k, v in draft_tensors.items() if not k.startswith("embed_tokens.")}
    opt_tensors, opt_meta = optimizer_tensors(optimizer_state)
    check_finite({**draft, **opt_tensors}, f"checkpoint of optimizer step {step}")
    for stale in root.glob(".tmp-*"):  # left by a save that was interrupted (never another live process's)
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    old = root / f".tmp-old-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        write_atomic(tmp / "draft.safetensors", lambda f: save_file(draft, f))  # each file flushed, umask's mode
        rng = {"rng.torch": torch.get_rng_state()}
        write_atomic(tmp / "optimizer.safetensors", lambda f: save_file({**opt_tensors, **rng}, f))
        state = {"step": step, "optimizer": opt_meta, "scheduler": scheduler_state, **extra}
        write_text_atomic(tmp / "state.json", json.dumps(state, indent=1, default=str))
        write_manifest(tmp)
        if final.exists():  # re-saving a step: move the old one aside so a crash never leaves neither
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:  # a failed write (a full disk, a vanished folder): nothing partial left
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            try:
                os.replace(old, final)
            except OSError:
                pass  # still whole beside it; the next save of this process removes it
        raise
    shutil.rmtree(old, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _abandoned(temporary: Path) -> bool:
    """A save's temporary folder (named ...-<pid>) whose process is this one or no longer runs."""
    pid = temporary.name.rsplit("-", 1)[-1]
    return not pid.isdigit() or int(pid) == os.getpid() or not psutil.pid_exists(int(pid))


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())


def checkpoint_problems(path: Path) -> list[str]:
    """Each way checkpoint `path` is damaged ([] if none): checked against its manifest; one
    written before manifests existed only as far as opening its files (a cut file's header no
    longer covers it, its JSON no longer parses)."""
    path = Path(path)
    problems = manifest_problems(path)
    if problems is not None:
        return problems
    problems = []
    for name in ("draft.safetensors", "optimizer.safetensors"):
        try:
            with safe_open(path / name, "pt"):
                pass
        except Exception as err:  # safetensors' own error type; a missing file
            problems.append(f"{path / name} cannot be read ({err})")
    try:
        read_state(path)
    except (OSError, ValueError) as err:
        problems.append(f"{path / 'state.json'} cannot be read ({err})")
    return problems


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of the run that verifies (what a failed run's progress is)."""
    return next((p for p in reversed(list_checkpoints(run_dir)) if not checkpoint_problems(p)), None)


def pick_checkpoint(resume: str, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint `train.resume` names and the notes to print: `auto` the newest that
    verifies, each newer one it skipped named with why; a named checkpoint that does not verify is
    refused (ValueError) with the damaged file and the way on. None: start fresh."""
    if resume in ("none", "", None):
        return None, []
    notes = []
    if resume == "auto":
        found = list_checkpoints(run_dir)
        for path in reversed(found):
            problems = checkpoint_problems(path)
            if not problems:
                if manifest_problems(path) is None:
                    notes.append(f"{path} has no manifest (written before checkpoints carried one): not verified")
                return path, notes
            notes.append(f"skipped {path}: " + "; ".join(problems))
        if found:
            raise ValueError(f"train.resume=auto: no checkpoint in {Path(run_dir) / 'checkpoints'} is intact ("
                             + " | ".join(notes) + f"); start a new run in another train.out_dir")
        return None, notes
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"train.resume={resume}: not a checkpoint folder (no state.json)")
    problems = checkpoint_problems(path)
    if problems:
        raise ValueError(f"train.resume={resume} is damaged: " + "; ".join(problems)
                         + " (train.resume=auto resumes from the newest intact checkpoint of its run)")
    if manifest_problems(path) is None:
        notes.append(f"{path} has no manifest (written before checkpoints carried one): not verified")
    return path, notes


def read_state(path: Path) -> dict:
    """A checkpoint's state.json (step, plan cursor, fingerprint, ...) without loading tensors."""
    return json.loads((Path(path) / "state.json").read_text())


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(state.json's content, draft tensors, optimizer state dict) of a checkpoint; restores the RNG."""
    path = Path(path)
    state = read_state(path)
    tensors = load_file(path / "optimizer.safetensors")
    per_param: dict = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            pid, name = key[len("state."):].rsplit(".", 1)  # a parameter name may hold dots, a state name not
            per_param.setdefault(int(pid) if pid.isdigit() else pid, {})[name] = value
    torch.set_rng_state(tensors["rng.torch"])
    optim = {"state": per_param, "param_groups": state["optimizer"]["param_groups"]}
    return state, load_file(path / "draft.safetensors"), optim


def check_draft_keys(path: Path, draft, tensors: dict) -> None:
    expected = {k for k in draft.state_dict() if not k.startswith("embed_tokens.")}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the draft: missing {missing}, unexpected {unexpected}")


def load_checkpoint(path: Path, draft, optimizer=None, scheduler=None) -> dict:
    """Restore into existing (unsharded) objects; returns state.json's content."""
    state, tensors, optim = read_checkpoint(path)
    check_draft_keys(path, draft, tensors)
    draft.load_state_dict(tensors, strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(optim)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return state
