"""Shared fixtures: the embedded targets (built once into the cache, outside git)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_SILENT", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))  # helper modules and scripts
from parallel_groups import start_rank, xdist_group_of  # noqa: E402

try:  # property tests: the same examples on every run (CI must not turn red by chance);
    # HYPOTHESIS_PROFILE=explore draws new ones when hunting for counterexamples
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
except ImportError:
    pass


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (every engine test starts processes of its own)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_itemcollected(item):
    # here, not in pytest_collection_modifyitems: xdist reads the marks in its own modifyitems hook,
    # which runs before any conftest's
    if item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


def pytest_collection_modifyitems(config, items):
    items.sort(key=start_rank)  # stable: the order within a group is kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread avoids oversubscription stalls on a busy CI box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path():
    from specforge_k25.target_engine.models import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="session")
def tiny_deepseek_path(smollm2_path):
    from specforge_k25.target_engine.models import tiny_deepseek_path

    return str(tiny_deepseek_path(smollm2_path))


def _sglang_capture(model_path: str, points: list[int], seqs, **spec_fields):
    """Run the real SGLang engine in its own process through the stream, as the trainer does; two
    batches (several packed sequences, then one). Returns [(lengths, aux, final)] per batch.
    `spec_fields` go to TargetSpec (e.g. tp_size=2)."""
    from specforge_k25.stream.target_stream import TargetStream
    from specforge_k25.target_engine.factory import TargetSpec
    from specforge_k25.target_engine.hf_config import read_target_info

    info = read_target_info(model_path)
    spec = TargetSpec(engine="sglang", model_path=model_path, architecture=info.architecture, capture_points=points,
                      **{"num_threads": 2, **spec_fields})
    plan = [list(range(len(seqs) - 1)), [len(seqs) - 1]]
    out = []
    with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=2, timeout_s=300) as stream:
        for msg, aux, final in stream:
            out.append((msg.lengths, aux.clone(), final.clone()))
            stream.release(msg)
    return out


@pytest.fixture(scope="session")
def sglang_capture():
    return _sglang_capture
