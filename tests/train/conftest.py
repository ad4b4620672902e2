"""Fixtures of the training tests."""
from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(scope="session")
def base_reference_run(tmp_path_factory):
    """One uninterrupted CLI run of test_reliability.BASE (tiny DeepSeek, one target process): the
    folder whose losses and export the runs with faults (kill -9, a killed pipeline stage) must
    reproduce. Run once for all of them."""
    from test_reliability import _cmd, _env

    ref_dir = tmp_path_factory.mktemp("reference") / "ref"
    ref = subprocess.run(_cmd(ref_dir), capture_output=True, text=True, timeout=900, env=_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    return ref_dir
