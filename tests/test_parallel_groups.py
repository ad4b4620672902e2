"""The suite's parallel run (pytest-xdist, `--dist loadgroup`, tests/conftest.py): tests that share an
expensive fixture must reach one worker, or that fixture (an engine, an end-to-end run) runs once
per worker."""
from __future__ import annotations

import os

import pytest

from parallel_groups import xdist_group_of


@pytest.fixture(scope="module")
def module_resource():
    return object()


@pytest.mark.parametrize("i", range(2))
def test_a_module_fixture_groups_the_file(module_resource, request, i):
    assert xdist_group_of(request.node) == "tests/test_parallel_groups.py"
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist appends the group it schedules by to the test's id
        assert request.node.nodeid.endswith("@tests/test_parallel_groups.py"), request.node.nodeid


def test_a_test_without_shared_fixtures_is_its_own_group(request, tmp_path):
    assert xdist_group_of(request.node) == request.node.nodeid.split("@")[0]


def test_a_session_fixture_of_ours_names_the_group(request):
    """The fault runs of two files share one reference run (tests/train/conftest.py)."""
    wanted = {"tests/train/test_reliability.py::test_kill9_then_resume_gives_identical_losses",
              "tests/train/test_pipeline_run.py::test_pipeline_target_run_killed_stage_resume_equals_one_stage"}
    items = [i for i in request.session.items if i.nodeid.split("@")[0] in wanted]
    if len(items) < 2:
        pytest.skip("the fault runs are not collected in this run")
    assert [xdist_group_of(i) for i in items] == ["base_reference_run"] * 2
