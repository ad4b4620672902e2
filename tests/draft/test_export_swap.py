"""Re-publishing a serving folder swaps it as checkpoints do: the new folder is complete beside
the old one, the old is moved aside, the new renamed into place, and only then the old removed. A
crash at any point leaves a complete export (the new one, or the old one moved aside, which the
next publish puts back), never a half-deleted folder."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from specforge_k25.draft import export_folder
from specforge_k25.draft.export_folder import publish_folder
from safetensors.torch import load_file


def _publish(out: Path, value: float) -> Path:
    return publish_folder(out, {"w": torch.full((4,), value)}, {"version": value}, validate=lambda folder: None)


def _version(folder: Path) -> float:
    """The export a folder holds, checked complete: its config and its tensors agree."""
    config = json.loads((folder / "config.json").read_text())
    assert torch.equal(load_file(folder / "model.safetensors")["w"], torch.full((4,), config["version"]))
    return config["version"]


def test_the_live_export_is_never_deleted_in_place(tmp_path, monkeypatch):
    out = _publish(tmp_path / "export", 1.0)
    removed = []  # (folder removed, the version the live folder holds at that moment)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).exists():
            removed.append((Path(path), _version(out) if out.exists() else None))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(export_folder.shutil, "rmtree", rmtree)
    _publish(out, 2.0)
    assert _version(out) == 2.0
    assert out not in [path for path, _ in removed]  # never the live folder itself
    assert [live for _, live in removed] == [2.0]  # the old one goes once the new one is in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_crash_between_the_renames_keeps_the_old_export_and_the_next_publish_recovers(tmp_path, monkeypatch):
    out = _publish(tmp_path / "export", 1.0)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        if not Path(src).is_dir():  # the files written inside the new folder
            return real_replace(src, dst)
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # the old folder is aside, the new one not yet in place
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(export_folder.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _publish(out, 2.0)
    monkeypatch.setattr(export_folder.os, "replace", real_replace)
    assert calls[0] == ("export", "export.old")
    assert _version(tmp_path / "export.old") == 1.0  # complete, only moved
    assert _version(tmp_path / "export.tmp") == 2.0
    _publish(out, 3.0)
    assert _version(out) == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_crash_before_the_swap_leaves_the_old_export_in_place(tmp_path, monkeypatch):
    out = _publish(tmp_path / "export", 1.0)
    real_replace = os.replace

    def replace(src, dst):
        if not Path(src).is_dir():
            return real_replace(src, dst)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(export_folder.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _publish(out, 2.0)
    assert _version(out) == 1.0


def test_an_old_export_left_aside_is_put_back_when_there_is_none(tmp_path):
    """A crash between the renames left only <out>.old: the next publish of a folder that fails
    validation still leaves that export where readers look."""
    out = _publish(tmp_path / "export", 1.0)
    os.replace(out, tmp_path / "export.old")

    def invalid(folder):
        raise ValueError("bad export")

    with pytest.raises(ValueError, match="bad export"):
        publish_folder(out, {"w": torch.zeros(4)}, {"version": 0.0}, validate=invalid)
    assert _version(out) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
