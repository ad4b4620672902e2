"""The GPU check's SGLang path on the bare H200 image, seen from a CPU: the imports SGLang runs inside
functions there (tests/benchmarks/sglang_cuda_path.py), and the walker that finds them."""
from __future__ import annotations

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
