"""A cheap digest of what defines a target model folder: its config and its weights, so that a
resume notices another model of the same shapes (a fine-tune, another revision).

Weight files are never read whole (a Kimi-K2.5 folder holds ~600 GB): each contributes its name,
its size and three windows of SAMPLE bytes (its start, which for safetensors is the header with
every tensor's name, dtype, shape and offset; its middle; its end). A fine-tune or a re-quantization
changes the weight bytes everywhere, so the windows differ; an edit confined to bytes no window
covers goes unnoticed, the price of not reading the folder. The JSON files (config.json, a
sharded checkpoint's *.index.json) are small and hashed whole."""
from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLE = 256 << 10  # bytes per window: 3 windows x 64 shards of Kimi-K2.5 read ~48 MiB


def _defines_the_model(path: Path) -> bool:
    return path.is_file() and (path.name == "config.json" or path.name.endswith(".index.json")
                               or path.suffix in WEIGHT_SUFFIXES)


def target_digest(folder: str | Path) -> str:
    """sha256 over config.json, the index files and the windows of every weight file, by name."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted((p for p in root.iterdir() if _defines_the_model(p)), key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as fh:
            if path.suffix == ".json":
                digest.update(fh.read())
                continue
            for start in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                fh.seek(start)
                digest.update(fh.read(SAMPLE))
    return digest.hexdigest()
