"""The GPU check's SGLang path on the bare H200 image, seen from a CPU: the imports SGLang runs inside
functions there (tests/benchmarks/sglang_cuda_path.py), and the walker that finds them."""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from import_reach import Reach  # noqa: E402


def _image_only_env() -> dict:
    """Only the H200 image's packages, the carried wheels and this project (tests/fixtures/gpu_image_site);
    no SGLANG_* settings of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    path = [str(ROOT / "tests" / "fixtures" / "gpu_image_site"), str(ROOT)]
    return {**env, "SPECFORGE_GPU_IMAGE_ONLY": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])}


def _describe(failed: list[dict]) -> str:
    return "\n".join(f"{f['module']} at {f['where']}: {f['error']}\n    reached by " + "\n      <- ".join(f["chain"])
                     for f in failed)


@pytest.mark.slow
def test_sglang_cuda_path_imports_only_what_the_image_has():
    """Every import on the check's CUDA path (module level and inside the functions the engines run)
    works with the image's packages, the carried wheels and sglang_cpu_compat.apply_gpu()."""
    proc = subprocess.run([sys.executable, str(HERE / "sglang_cuda_path.py")], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=_image_only_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("SCAN ", 1)[1])
    assert not result["failed"], "imports the H200 image would fail:\n" + _describe(result["failed"])
    assert result["functions"] > 1000, result  # the walk reached the engines' code, not a stub of it


def test_image_only_packages_are_on_the_image_list():
    import sglang_cuda_path

    listed = {line.split("#")[0].strip() for line in (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text()
              .splitlines()}
    assert set(sglang_cuda_path.IMAGE_ONLY.values()) <= listed


_PACKAGE = {
    "__init__.py": "",
    "kernel.py": "import reach_fixture_missing_a\n",
    "top.py": '''
        _is_hip = False


        class Helper:
            def __init__(self):
                self.mode = self._select()

            def _select(self):
                from reachfix.kernel import fused
                return fused

            def unused(self):
                import reach_fixture_never_called


        class Top:
            def __init__(self):
                self.helper = Helper()
                if _is_hip:
                    import reach_fixture_other_platform
                try:
                    import reach_fixture_optional
                except ImportError:
                    pass
                table = {"triton": later, "fa3": other_backend, "flashinfer": other_backend}
                table["triton"]()

            def run(self):
                lazy()


        def later():
            import json


        def other_backend():
            import reach_fixture_other_backend


        def lazy():
            import reach_fixture_switched_off


        def hip_only():
            if not _is_hip:
                return
            import reach_fixture_after_return


        def entry():
            hip_only()
            Top().run()
    ''',
}


def test_import_reach_reports_a_lazy_import_with_its_line_and_chain(tmp_path):
    """A failing import two calls and a module load away is reported at its file:line with the chain;
    code not reached, other platforms' branches, guarded imports, other backends' entries and skipped
    imports are not; a skipped key that names nothing is."""
    (tmp_path / "reachfix").mkdir()
    for name, text in _PACKAGE.items():
        (tmp_path / "reachfix" / name).write_text(textwrap.dedent(text))
    sys.path.insert(0, str(tmp_path))
    try:
        skipped = {"reachfix.top:lazy -> reach_fixture_switched_off": "off here", "reachfix.top:gone": "stale"}
        result = Reach("reachfix", ["reachfix.top:entry", "reachfix.top:Top.run"], skipped, backend="triton").run()
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "reachfix" or m.startswith("reachfix.")]:
            del sys.modules[name]
    failed = {f["module"]: f for f in result["failed"]}
    assert sorted(failed) == ["reachfix.kernel", "reachfix.top:gone"], _describe(result["failed"])
    lazy = failed["reachfix.kernel"]
    assert lazy["where"] == "reachfix/top.py:10" and "reach_fixture_missing_a" in lazy["error"], lazy
    assert [c.split(" ")[0] for c in lazy["chain"]] == ["reachfix.top:Helper._select", "reachfix.top:Helper.__init__",
                                                        "reachfix.top:Top.__init__", "reachfix.top:entry"], lazy


# ------------------------------------------------------------------ benchmarks/gpu_e2e.py on one lent run
def _gpu_e2e():
    benchmarks = str(ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import gpu_e2e

    return gpu_e2e


def test_gpu_e2e_writes_under_out_when_the_device_tool_sets_it(monkeypatch, tmp_path):
    g = _gpu_e2e()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert g.default_out(g.parse_args(["--checks", "abc"])) == tmp_path / "gpu_e2e_abc.json"
    assert g.default_out(g.parse_args(["--checks", "d"])) == tmp_path / "gpu_e2e_d.json"
    assert g.default_out(g.parse_args([])) == tmp_path / "gpu_e2e.json"
    monkeypatch.delenv("OUT")
    assert g.default_out(g.parse_args(["--checks", "d"])) == ROOT / "docs" / "gpu_h200" / "gpu_e2e_d.json"


def test_gpu_e2e_cuda_env_makes_triton_fp32_exact(monkeypatch, tmp_path):
    """TF32 in SGLang's fp32 triton attention would fail a)'s 1e-4 bound and d) by arithmetic."""
    import triton

    for name in ("TRITON_F32_DEFAULT", "PYTHONUNBUFFERED", "CUDA_HOME", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored after: prepare_env puts the toolkit's bin first
    _gpu_e2e().prepare_cuda_env(tmp_path)
    assert triton.knobs.language.fp32_default == "ieee" and os.environ["PYTHONUNBUFFERED"] == "1"
    assert os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"


def test_gpu_e2e_one_graphs_mode_failing_keeps_the_other(monkeypatch, tmp_path):
    """d) with CUDA graphs off and on: an engine that fails in one mode is that mode's FAIL row (with its
    traceback), and the other mode's result stands; one greedy engine (graphs off) serves every head."""
    from types import SimpleNamespace

    _gpu_e2e()
    import gpu_spec

    calls = []

    def generate(model_path, prompts, *, cuda_graph, draft_path=None, timeout_s, **kw):
        calls.append((cuda_graph, draft_path is not None))
        if cuda_graph:
            raise RuntimeError("SGLang engine (chain 3/1/4) failed (exit 1):\nweak_ref_tensor was called")
        return SimpleNamespace(outputs=[[5, 6]] * len(prompts), completion_tokens=[2] * len(prompts),
                               verify_steps=[1] * len(prompts) if draft_path else None, start_s=1.0, generate_s=0.1)

    monkeypatch.setattr(gpu_spec, "generate", generate)
    monkeypatch.setattr(gpu_spec, "export_draft", lambda draft, out, *a, **k: out)
    monkeypatch.setattr(gpu_spec, "hf_hidden", lambda *a: [None] * 4)
    monkeypatch.setattr(gpu_spec, "replay_steps", lambda *a: [1] * 4)
    from specforge_k25.draft.registry import get_method

    setup = SimpleNamespace(model_path=str(tmp_path), sglang_capture_ids=[], capture_points=[], info=SimpleNamespace(
        bos_token_id=1, eos_token_id=2, vocab_size=100), method=get_method("eagle3"))
    mla = SimpleNamespace(**{**vars(setup), "method": get_method("eagle3_mla")})
    args = _gpu_e2e().parse_args(["--device", "cuda"])
    rows, errors = gpu_spec.serve(args, {"eagle3": (setup, None), "eagle3_mla": (mla, None)}, tmp_path,
                                  _gpu_e2e().SIZES["small"], {"eagle3": [False, True], "eagle3_mla": [False]})
    assert [(r["head"], r["cuda_graph"]) for r in rows] == [("eagle3", False), ("eagle3", True), ("eagle3_mla", False)]
    assert rows[0]["ok"] and rows[0]["identical"] == 4 and rows[2]["ok"], rows
    assert not rows[1]["ok"] and rows[1]["error"].startswith("RuntimeError: SGLang engine"), rows[1]
    assert list(errors) == ["eagle3 graphs on"] and "weak_ref_tensor was called" in errors["eagle3 graphs on"]
    assert calls == [(False, False), (False, True), (True, True), (False, True)]


def test_gpu_e2e_engines_left_past_the_deadline_are_skip_rows(monkeypatch, tmp_path):
    """An engine with less than MIN_ENGINE_S before the deadline is not started: its row says SKIP and why."""
    from types import SimpleNamespace

    _gpu_e2e()
    import gpu_spec

    monkeypatch.setattr(gpu_spec, "generate", lambda *a, **k: pytest.fail("an engine started past the deadline"))
    monkeypatch.setattr(gpu_spec, "export_draft", lambda draft, out, *a, **k: out)
    from specforge_k25.draft.registry import get_method

    setup = SimpleNamespace(model_path=str(tmp_path), sglang_capture_ids=[], capture_points=[], info=SimpleNamespace(
        bos_token_id=1, eos_token_id=2, vocab_size=100), method=get_method("dflash"))
    args = _gpu_e2e().parse_args(["--device", "cuda"])
    import time

    rows, _ = gpu_spec.serve(args, {"dflash": (setup, None)}, tmp_path, _gpu_e2e().SIZES["small"],
                             {"dflash": [False]}, deadline=time.time() + 10)
    assert rows[0]["ok"] is None and "skipped" in rows[0]["skipped"], rows
    assert gpu_spec.describe(rows[0], "e")[0] == "SKIP"


def test_gpu_e2e_merges_each_step_into_one_json(monkeypatch, tmp_path):
    """The device command runs c, d, e, b as separate processes into one JSON (--merge): each keeps the
    others' results and lines; a FAIL in any makes the whole not ok."""
    g = _gpu_e2e()
    out = tmp_path / "gpu_e2e.json"
    first = g.Run(g.parse_args(["--device", "cpu", "--checks", "c", "--out", str(out), "--merge"]), out)
    first.put("c_slots", {"ok": True})
    first.emit("PASS", "c) fine")
    first.save(done=True)
    second = g.Run(g.parse_args(["--device", "cpu", "--checks", "e", "--out", str(out), "--merge"]), out)
    second.emit("FAIL", "e) broken")
    saved = json.loads(out.read_text())
    assert saved["c_slots"] == {"ok": True} and saved["lines"] == ["PASS c) fine", "FAIL e) broken"]
    assert set(saved["runs"]) == {"c", "e"} and saved["runs"]["e"]["running"] and not saved["ok"]


def test_gpu_e2e_preflight_builds_what_the_engines_compile_and_shows_a_failed_build():
    """The EAGLE tree kernels SGLang compiles at run time on CUDA (no fallback) are what the preflight
    builds; a build that fails comes back with its log."""
    _gpu_e2e()
    import importlib.util

    import _gpu_device

    speculative = Path(importlib.util.find_spec("sglang").submodule_search_locations[0], "kernels/ops/speculative")
    tree = (speculative / "tree.py").read_text()
    assert "def _jit_tree_module(" in tree and "load_jit(" in tree and "def verify_tree_greedy(" in tree
    assert "from sglang.kernels.ops.speculative.tree import" in (speculative / "spec_tree.py").read_text()
    failed = _gpu_device._build("raise RuntimeError('ninja: build stopped: subcommand failed')\n", 120)
    assert not failed["built"] and "ninja: build stopped" in failed["log"], failed
    built = _gpu_device._build("pass\n", 120)
    assert built["built"] and built["seconds"] is not None, built


# ---------------------------------------------------------- one co-located rank in its own group
def test_one_rank_group_switch_builds_a_group_and_shards_only_co_located(monkeypatch):
    """SPECFORGE_ONE_RANK_GROUP=1 (benchmarks/gpu_cli.py's launch): one co-located rank gets a process
    group (gloo here, NCCL on CUDA) and counts as distributed, so the learner shards its draft as a
    node's ranks do; without the switch, or dedicated, one rank stays the plain single process."""
    import torch.distributed as dist

    from specforge_k25.config import JobConfig
    from specforge_k25.setup.layout import World
    from specforge_k25.train.distributed import ONE_RANK_GROUP, start_ranks, stop_ranks

    job = JobConfig()
    job.hw.trainer_layout = "colocated"
    job.train.dist_timeout_s = 60
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    _, plain = start_ranks(job, World())
    assert not plain.distributed and not dist.is_initialized()
    monkeypatch.setenv(ONE_RANK_GROUP, "1")
    dedicated = JobConfig()
    _, alone = start_ranks(dedicated, World())
    assert not alone.distributed and not dist.is_initialized()
    _, ranks = start_ranks(job, World())
    try:
        assert ranks.distributed and ranks.colocated and ranks.world == 1 and dist.is_initialized()
        assert dist.get_backend() == "gloo"
    finally:
        stop_ranks(ranks)
    assert not dist.is_initialized()
