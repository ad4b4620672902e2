"""Where specforge_k25 keeps what it builds once (embedded targets, the local Kimi tokenizer):
`$SPECFORGE_CACHE`, default `~/.cache/specforge_k25`, outside git."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("SPECFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specforge_k25")
    return Path(root)
