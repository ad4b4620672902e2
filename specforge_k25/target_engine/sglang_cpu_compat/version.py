"""The SGLang version every workaround of this package is written for and checked against: the one
place it is written (the package re-exports it; sglang_engine.py refuses any other at start-up)."""
from __future__ import annotations

SGLANG_VERSION = "0.5.23"
