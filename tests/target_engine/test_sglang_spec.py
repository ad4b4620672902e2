"""The eval's engine process (target_engine/sglang_spec.py) when SGLang fails at start: the error
names SGLang's reason, and the scheduler's load-snapshot file is not left in /dev/shm."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from specforge_k25.target_engine.sglang_spec import generate, load_snapshot_path

SHM = Path("/dev/shm")


def _new_load_snapshots(since: float) -> set[str]:
    return {p.name for p in SHM.glob("sglang_loads_*") if p.stat().st_mtime >= since}


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_an_engine_that_fails_at_start_names_why_and_leaves_no_load_snapshot(smollm2_path):
    since = time.time() - 1
    # A token cap of 0 leaves nothing for the KV pool whatever memory is free, so SGLang fails after
    # its scheduler made the file (a tiny mem_fraction_static did not fail on CI: available memory
    # is measured twice, and other test workers freed memory in between).
    with pytest.raises(RuntimeError, match="mem-fraction-static"):
        generate(smollm2_path, [[1, 2, 3]], max_new_tokens=2, max_total_tokens=0, timeout_s=600)
    assert _new_load_snapshots(since) == set()


def test_the_load_snapshot_path_is_sglangs():
    from sglang.srt.managers.load_snapshot import shm_path_for

    for instance_id in ("2075bec33d00", "a/b c", "x/", ""):
        assert load_snapshot_path(instance_id) == shm_path_for(instance_id)
