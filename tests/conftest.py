"""Shared fixtures: the embedded targets (built once into the cache, outside git)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def smollm2_path():
    from specforge_k25.target.models import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="session")
def tiny_deepseek_path(smollm2_path):
    from specforge_k25.target.models import tiny_deepseek_path

    return str(tiny_deepseek_path(smollm2_path))
