"""The one device command of the GPU check (benchmarks/gpu_check.py) and its pieces, on a CPU: the global
deadline, a CUDA toolkit in the pip layout, the memory bounds, the hand-off verdict, the replay agreement."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_benchmarks import image_only_env

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def bench(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return __import__(name)


# ------------------------------------------------------------------------------ the deadline
def _py(code: str) -> list[str]:
    return ["-c", textwrap.dedent(code)]


def test_a_slow_step_is_killed_later_steps_still_run_and_what_has_no_time_is_skipped(tmp_path, monkeypatch):
    """Planted: a step that sleeps past its timeout (and leaves a child of its own behind) is killed with
    its child, recorded as timeout, and the steps after it still run and write their files; a step that
    needs more time than is left is skipped with the reason; the summary JSON holds all of it."""
    g = bench("gpu_check")
    out = tmp_path / "out"
    pid_file = tmp_path / "child.pid"
    steps = [
        g.Step("first", _py(f"open(r'{out / 'first.json'}', 'w').write('{{}}'); print('first done')"), 30, 0),
        g.Step("slow", _py(f"""
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open(r"{pid_file}", "w").write(str(child.pid))
            print("slow started", flush=True)
            time.sleep(120)"""), 3, 0),
        g.Step("after", _py(f"open(r'{out / 'after.json'}', 'w').write('{{}}'); print('after done')"), 30, 0),
        g.Step("late", _py("print('never')"), 30, 10_000),
    ]
    monkeypatch.setattr(g, "steps_for", lambda *a, **k: steps)
    t0 = time.time()
    summary = g.main(["--device", "cpu", "--out", str(out), "--budget-s", "60"])
    assert time.time() - t0 < 30
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("first", "pass"), ("slow", "timeout"), ("after", "pass"), ("late", "skipped")], summary["steps"]
    assert "deadline" in summary["steps"][3]["reason"] and not summary["ok"]
    assert (out / "first.json").is_file() and (out / "after.json").is_file()
    saved = json.loads((out / "gpu_check.json").read_text())
    assert [s["status"] for s in saved["steps"]] == ["pass", "timeout", "pass", "skipped"]
    log = (out / "gpu_check.log").read_text()
    assert "[slow] slow started" in log and "[after] after done" in log and "SKIP step late" in log
    status = Path(f"/proc/{int(pid_file.read_text())}/status")  # killed with its step's process group
    time.sleep(0.2)
    assert not status.exists() or "State:\tZ" in status.read_text()
    assert saved["prepared"]["env"]["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"


def test_a_step_gets_only_the_time_left(tmp_path, monkeypatch):
    """The global deadline cuts a step's own timeout: a 60 s step with 3 s left is killed at ~3 s."""
    g = bench("gpu_check")
    monkeypatch.setattr(g, "steps_for", lambda *a, **k: [g.Step("long", _py("import time; time.sleep(60)"), 60, 0)])
    t0 = time.time()
    summary = g.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "3"])
    assert summary["steps"][0]["status"] == "timeout" and summary["steps"][0]["timeout_s"] <= 3
    assert time.time() - t0 < 20


def test_the_device_steps_stay_in_budget_and_write_under_out(tmp_path):
    """Every step of the device command writes under --out (nothing under benchmarks/results), the
    steps' own timeouts fit the device tool's 10-minute command, and $OUT stays within 8 files."""
    g = bench("gpu_check")
    steps = g.steps_for("cuda", False, tmp_path, time.time() + 480)
    assert [s.name for s in steps][:2] == ["preflight", "c"]
    for s in steps:
        outs = [a for a in s.argv if str(tmp_path) in a]
        assert outs, s.argv
        assert s.timeout_s <= 300 and s.min_s < s.timeout_s
    files = {"gpu_check.json", "gpu_check.log"} | {f for s in steps for f in s.outputs}
    assert len(files) <= g.MAX_FILES, files


# --------------------------------------------------------------------------- the CUDA toolkit
FAKE_CUDART = "int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }\n"
USER = "int cudaRuntimeGetVersion(int *v);\nint main(void) { int v = 0; cudaRuntimeGetVersion(&v); return v == 13000 ? 0 : 1; }\n"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build and link a stand-in libcudart")
def test_a_pip_layout_toolkit_gets_a_cuda_home_the_jit_can_link_against(tmp_path):
    """The pip layout (nvidia/cu13: bin/nvcc, lib/libcudart.so.13 only) fails tvm-ffi's link line
    `-L$CUDA_HOME/lib64 -lcudart` ("cannot find -lcudart"); the preflight's CUDA_HOME links, the
    program records the soname and runs. The nvcc on PATH may be a wrapper script: its target is found."""
    p = bench("gpu_preflight")
    site = tmp_path / "site"
    kit = site / "nvidia" / "cu13"
    for d in ("bin", "include", "lib"):
        (kit / d).mkdir(parents=True)
    (kit / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (kit / "bin" / "nvcc").chmod(0o755)
    (tmp_path / "cudart.c").write_text(FAKE_CUDART)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcudart.so.13", "-o", str(kit / "lib" / "libcudart.so.13"),
                    str(tmp_path / "cudart.c")], check=True)
    (tmp_path / "user.c").write_text(USER)

    def link(home: str) -> subprocess.CompletedProcess:
        return subprocess.run(["gcc", str(tmp_path / "user.c"), f"-L{home}/lib64", "-lcudart", "-o",
                               str(tmp_path / "a.out")], capture_output=True, text=True)

    assert "cannot find -lcudart" in link(str(kit)).stderr  # what SGLang's JIT hits with CUDA_HOME = the kit
    env = {"PATH": "/usr/bin:/bin"}
    found = p.locate_toolkit(env, tmp_path / "tmp", site_dirs=[str(site)], system=())
    assert found["home"] == str(kit) and found["source"] == "pip layout" and "shim" in found["layout"], found
    assert link(found["cuda_home"]).returncode == 0
    needed = subprocess.run(["readelf", "-d", str(tmp_path / "a.out")], capture_output=True, text=True).stdout
    assert "libcudart.so.13" in needed  # the soname torch has loaded, not the shim's link
    assert subprocess.run([str(tmp_path / "a.out")], env={"LD_LIBRARY_PATH": str(kit / "lib")}).returncode == 0
    assert os.path.isfile(os.path.join(found["cuda_home"], "bin", "nvcc"))  # the rest of the kit is there too

    wrapper = tmp_path / "wrap"
    wrapper.mkdir()
    (wrapper / "nvcc").write_text(f'#!/bin/sh\nexec {kit}/bin/nvcc "$@"\n')
    (wrapper / "nvcc").chmod(0o755)
    found = p.locate_toolkit({"PATH": f"{wrapper}:/usr/bin:/bin"}, tmp_path / "tmp2", site_dirs=[], system=())
    assert found["home"] == str(kit) and found["source"] == "the nvcc the one on PATH runs", found
    assert link(found["cuda_home"]).returncode == 0
    env = {"PATH": f"{wrapper}:/usr/bin:/bin"}
    prepared = p.prepare_env(env, tmp_path / "tmp3", cuda=True)
    assert env["CUDA_HOME"] == prepared["toolkit"]["cuda_home"] and env["TRITON_F32_DEFAULT"] == "ieee"
    assert prepared["toolkit"]["nvcc_version"].startswith("Cuda compilation tools, release 13.0")


@pytest.mark.slow
def test_sglang_jit_builds_against_a_pip_layout_only_through_the_shim(tmp_path):
    """SGLang's EAGLE tree kernel (no fallback on CUDA), compiled for an H200 with this machine's nvcc into
    an empty JIT cache: against a pip-layout copy of the toolkit (lib/libcudart.so.13 only) the link fails
    with "cannot find -lcudart"; with the CUDA_HOME the preflight makes of it, it builds (~30 s)."""
    p, d = bench("gpu_preflight"), bench("_gpu_device")
    real = p.locate_toolkit(dict(os.environ), tmp_path / "real")
    if not real["home"] or not real["cudart"]:
        pytest.skip("no CUDA toolkit on this machine")
    kit = tmp_path / "site" / "nvidia" / "cu13"
    (kit / "lib").mkdir(parents=True)
    for entry in os.listdir(real["home"]):
        if entry not in ("lib", "lib64"):
            (kit / entry).symlink_to(os.path.join(real["home"], entry))
    (kit / "lib" / "libcudart.so.13").symlink_to(os.path.realpath(real["cudart"]))

    def build(cuda_home: str, cache: str) -> dict:
        env = {**os.environ, "CUDA_HOME": cuda_home, "SGLANG_JIT_CACHE_DIR": str(tmp_path / cache)}
        return d._build(d._TREE, 600, d.FAKE_H200, env)

    plain = build(str(kit), "plain")
    assert not plain["built"] and "cannot find -lcudart" in plain["log"], plain["log"][-2000:]
    found = p.locate_toolkit({"PATH": "/usr/bin:/bin"}, tmp_path / "shim", site_dirs=[str(tmp_path / "site")], system=())
    assert found["home"] == str(kit) and "shim" in found["layout"], found
    shimmed = build(found["cuda_home"], "shimmed")
    assert shimmed["built"], shimmed["log"][-2000:]


def test_no_toolkit_is_said_not_guessed(tmp_path):
    p = bench("gpu_preflight")
    found = p.locate_toolkit({"PATH": "/nonexistent"}, tmp_path, site_dirs=[], system=())
    assert found["home"] is None and found["cuda_home"] is None and found["layout"] == "no nvcc found"


def test_the_rust_radix_probe_names_a_failure(monkeypatch):
    """A Rust radix-tree extension that cannot load is reported with its error line, not raised."""
    p = bench("gpu_preflight")
    monkeypatch.setattr(p, "_RUST_PROBE", "raise ImportError('undefined symbol: _ZN3c104impl')")
    res = p.probe_rust_tree_core(60)
    assert not res["loads"] and "undefined symbol" in res["error"], res


# ------------------------------------------------------------------------------- the verdicts
def test_memory_bounds_catch_an_overestimate_and_an_underestimate():
    d = bench("_gpu_device")
    rows = d.owner_rows({"a": 100, "b": 100, "c": 100, "d": 100}, {"a": 40, "b": 80, "c": 120, "d": None})
    assert [rows[k]["ok"] for k in "abcd"] == [False, True, False, None]
    assert rows["b"]["ratio"] == 0.8


def test_handoff_verdict_needs_the_plant_to_fail():
    """c) passes only if every real copy matches AND the planted no-sync half lost batches."""
    h = bench("gpu_handoff")
    good, lost = (1.0, 1.0, True), (1.0, 2.0, False)
    assert h.summarize([good] * 4 + [lost, good, lost, good], 4, True, 0.01, 0.05)["ok"]
    no_power = h.summarize([good] * 8, 4, True, 0.01, 0.05)
    assert not no_power["ok"] and not no_power["planted_no_sync"]["has_power"]
    assert "NO power" in h.describe(no_power)
    assert not h.summarize([good, lost, good, good] + [lost] * 4, 4, True, 0.01, 0.05)["ok"]
    cpu = h.summarize([good] * 4, 4, False, 0.01, 0.0)
    assert cpu["ok"] and "planted_no_sync" not in cpu and "not on CPU" in h.describe(cpu)


def test_replay_agreement_allows_one_near_tie():
    s = bench("gpu_spec")
    assert s.steps_agree([10, 12, 9], [10, 12, 9]) and s.steps_agree([10, 12, 9], [10, 13, 9])
    assert not s.steps_agree([10, 12, 9], [11, 13, 9]) and not s.steps_agree([10, 12, 9], [10, 14, 9])
    assert not s.steps_agree(None, [1]) and not s.steps_agree([1, 2], [1])


# --------------------------------------------------------------------------- the whole command
@pytest.mark.engine
@pytest.mark.slow
def test_the_device_command_in_cpu_mode_runs_every_check(tmp_path):
    """`gpu_check.py --device cpu --small`: every step passes and writes what the device run brings
    back, DFlash and MLA EAGLE-3 served by SGLang included (~5 min on the busy 2-core box; the JIT
    compile is left to test_sglang_jit_builds_against_a_pip_layout_only_through_the_shim). It sees
    only the H200 image's packages and the carried wheels (`image_only_env`): an import the wheel
    list misses fails here."""
    out = tmp_path / "out"
    env = image_only_env()
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--small",
                           "--budget-s", "1500", "--no-compile", "--out", str(out)], capture_output=True, text=True, timeout=1700,
                          cwd=ROOT, env=env)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-4000:]
    assert [s["step"] for s in summary["steps"]] == ["preflight", "c", "d", "e", "kimi_steps", "b", "trainer_checks"]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_e2e.json", "gpu_kimi_shapes.json", "gpu_preflight.json"} <= set(files), files
    e2e = json.loads((out / "gpu_e2e.json").read_text())
    assert set(e2e["runs"]) == {"c", "d", "e", "b"} and e2e["ok"]
    assert [r["method"] for r in e2e["e_spec"]] == ["dflash", "eagle3_mla"]
    for row in e2e["d_spec"] + e2e["e_spec"]:
        assert row["identical"] == row["prompts"] and row["verify_steps"] and row["replay_steps"], row
    assert e2e["c_slots"]["ok"] and e2e["b_stream"]["kernels"].startswith("cpu")
    kimi = json.loads((out / "gpu_kimi_shapes.json").read_text())
    assert set(kimi["methods"]) == {"dflash", "eagle3"}
    assert all(r["status"] == "ok" for m in kimi["methods"].values() for r in m["shapes"])


@pytest.mark.slow
def test_the_checks_engine_arguments_resolve_on_an_h200(tmp_path):
    """The exact sglang.Engine arguments of d) and e) on CUDA (greedy, EAGLE-3 with graphs on, MLA EAGLE-3,
    DFlash; exported heads on the small random target) pass SGLang's ServerArgs resolution where torch
    reports an H200, with the draft workers on triton; a refused argument comes back with its message."""
    import torch

    e2e, spec, ea = bench("gpu_e2e"), bench("gpu_spec"), bench("gpu_engine_args")
    from specforge_k25.train.learner import build_learner

    cpu_args = e2e.parse_args(["--device", "cpu", "--small"])
    size = e2e.SIZES["small"]
    model = e2e.build_random_target(tmp_path / "target", True, 0)
    samples = e2e.random_samples(8, size["lengths"], e2e.SMALL["vocab_size"], 0)
    engines = spec.Engines(e2e.parse_args(["--device", "cuda"]), size, None, 150)
    prompts = spec.prompts_for(e2e.SMALL["vocab_size"], 0)
    configs = [ea.engine_args(engines, model, prompts, False)]
    for name, graphs in (("eagle3", True), ("eagle3_mla", False), ("dflash", False)):
        job = e2e.make_job(cpu_args, model, size, "float32")
        job.draft = spec.method_spec(name, size)
        setup = e2e.make_setup(job, model, samples)
        draft = build_learner(job, setup, 1, torch.device("cpu")).draft
        export = spec.export_draft(draft, tmp_path / name, setup.sglang_capture_ids, 1, 2,
                                   capture_points=setup.capture_points)
        serving = setup.method.servings(spec.CHAIN)[0]
        configs.append(ea.engine_args(engines, model, prompts, graphs, draft_path=str(export),
                                      draft_args=serving.sglang_args))
    assert configs[1]["disable_cuda_graph"] is False and configs[3]["disable_cuda_graph"] is True
    rows = ea.resolve_on_h200(configs + [dict(configs[0], no_such_argument=1)])
    assert all(r["ok"] for r in rows[:4]), rows
    assert [r["speculative_algorithm"] for r in rows[:4]] == [None, "EAGLE3", "EAGLE3", "DFLASH"], rows
    assert all(r["speculative_draft_attention_backend"] == "triton" for r in rows[1:4]), rows
    assert [r["speculative_num_draft_tokens"] for r in rows[1:4]] == [4, 4, 4], rows
    assert not rows[4]["ok"] and "no_such_argument" in rows[4]["error"], rows[4]
