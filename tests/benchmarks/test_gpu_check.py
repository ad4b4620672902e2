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
    steps' own timeouts fit the device tool's 10-minute command, $OUT stays within 8 files, the real
    command and the online memory come first and the repeats of past measurements last, and a
    4-minute machine start + the default budget + a rerun of 3 minutes fit the 15 device minutes."""
    g = bench("gpu_check")
    steps = g.steps_for("cuda", False, tmp_path, time.time() + 480)
    names = [s.name for s in steps]
    assert names[:3] == ["cli_deepseek", "cli_llama", "b"] and names[-2:] == ["kimi_steps", "trainer_checks"]
    for s in steps:
        outs = [a for a in s.argv if str(tmp_path) in a]
        assert outs or s.name == "mps", s.argv
        assert s.timeout_s <= 300 and s.min_s < s.timeout_s
    files = {"gpu_check.json", "gpu_check.log"} | {f for s in steps for f in s.outputs}
    assert len(files) <= g.MAX_FILES, files
    assert g.MACHINE_START_S + g.DEFAULT_BUDGET_S + g.RERUN_BUDGET_S <= g.DEVICE_BUDGET_S - 30


def test_rerun_failed_runs_only_what_did_not_pass_and_a_self_skip_is_not_a_failure(tmp_path, monkeypatch):
    """A step exiting 3 with a SKIP line is recorded as skipped with that line and keeps the check
    green; `--rerun-failed` reads the previous gpu_check.json and runs only the failed step again."""
    g = bench("gpu_check")
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    flag = tmp_path / "fixed"
    steps = [
        g.Step("good", _py(f"open(r'{marks}/good', 'a').write('x')"), 30, 0),
        g.Step("flaky", _py(f"import os, sys; open(r'{marks}/flaky', 'a').write('x'); "
                            f"sys.exit(0 if os.path.exists(r'{flag}') else 1)"), 30, 0),
        g.Step("mps", _py("import sys; print('SKIP MPS: 1 GPU(s)'); sys.exit(3)"), 30, 0),
    ]
    monkeypatch.setattr(g, "steps_for", lambda *a, **k: steps)
    first = g.main(["--device", "cpu", "--out", str(out), "--budget-s", "60"])
    assert [(r["step"], r["status"]) for r in first["steps"]] == [("good", "pass"), ("flaky", "fail"),
                                                                   ("mps", "skipped")]
    assert first["steps"][2]["reason"] == "SKIP MPS: 1 GPU(s)" and not first["ok"]
    flag.write_text("")
    again = g.main(["--device", "cpu", "--out", str(tmp_path / "second"), "--budget-s", "60", "--rerun-failed",
                    "--previous", str(out / "gpu_check.json")])  # the device's $OUT starts empty
    assert [(r["step"], r["status"]) for r in again["steps"]] == [("flaky", "pass")] and again["ok"]
    assert [r["step"] for r in again["previous"] if not r["rerun"]] == ["good", "mps"]
    assert (marks / "good").read_text() == "x" and (marks / "flaky").read_text() == "xx"
    with pytest.raises(SystemExit, match="no previous"):
        g.main(["--device", "cpu", "--out", str(tmp_path / "empty"), "--rerun-failed"])


def test_memory_report_fails_on_a_cached_gap_and_on_less_free_memory_than_planned():
    """train/memory_report.py's comparison on planted figures: each bound can fail, and figures inside
    both bounds pass. SGLang's log lines are parsed as sglang 0.5.23 writes them."""
    from specforge_k25.train.memory_report import GB, compare, engine_figures

    log = ("[sglang] Load weight begin. avail mem=130.25 GB\n"
           "[sglang] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 16384, K size: 0.05 GB, V size: 0.05 GB\n"
           "[sglang] Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, #tokens: 12288, "
           "KV size: 0.07 GB, avail mem=120.00 GB\n")
    engine = engine_figures(log)
    assert engine == {"free_before_load": int(130.25 * GB), "kv_pool_tokens": 12288}
    assert engine_figures("nothing logged") == {"free_before_load": None, "kv_pool_tokens": None}
    plan = {"free_before_load": 130 * GB, "kv_pool_tokens": 12288}
    fine = {"allocated": 10 * GB, "reserved": 10 * GB + GB // 2}
    assert compare(fine, plan, engine, max_cached_bytes=GB) == []
    cached = {"allocated": 10 * GB, "reserved": 13 * GB}  # planted: 3 GiB cached, unused
    problems = compare(cached, plan, engine, max_cached_bytes=GB)
    assert len(problems) == 1 and "caches 3.00 GiB" in problems[0], problems
    short = engine_figures(log.replace("130.25", "100.00"))  # planted: SGLang saw 100 GiB, the plan 130
    problems = compare(fine, plan, short, max_cached_bytes=GB)
    assert len(problems) == 1 and "measured 100.00 GiB free" in problems[0], problems
    problems = compare(fine, dict(plan, kv_pool_tokens=16384), engine, max_cached_bytes=GB)  # planted: a bigger plan
    assert problems == ["SGLang's KV pool holds 12288 tokens, the plan 16384"], problems
    assert compare({"allocated": None, "reserved": None}, {"free_before_load": None}, engine, GB) == []  # CPU


def test_only_a_kernel_the_image_lacks_makes_a_cli_run_a_skip():
    c = bench("gpu_cli")
    assert "flash_mla" in c.missing_kernel("x\nModuleNotFoundError: No module named 'flash_mla'\nexit")
    assert c.missing_kernel("RuntimeError: CUDA error: no kernel image is available for execution on the device")
    assert c.missing_kernel("ModuleNotFoundError: No module named 'xgrammar'") is None  # the wheel list's miss: FAIL
    assert c.missing_kernel("NotImplementedError: some op") is None


def test_the_cli_steps_cuda_overrides_compose_and_the_plan_counts_the_free_memory(tmp_path, monkeypatch):
    """gpu_cli.py's arguments on the H200 compose into the job the CLI would run (both optimizer
    placements, resumed), and the plan of that job has the figures memory_report compares with."""
    import types

    import torch

    c = bench("gpu_cli")
    from specforge_k25.config import compose_job
    from specforge_k25.plan import facts_from_folder, plan_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=143771 << 20))
    args = c.argparse.Namespace(device="cuda", small=False)
    model = c.build_targets(tmp_path, "llama", small=True)
    for variant in c.VARIANTS:
        job = compose_job(c.overrides(args, model, tmp_path / "data.jsonl", variant) + ["train.resume=auto"])
        assert (job.hw.device, job.hw.trainer_layout, job.hw.gpu_memory_mib) == ("cuda", "colocated", 143771)
        assert job.train.optimizer_device == ("cpu" if variant == "cpu" else None) and job.train.checkpoint_every == 10
        assert type(job.draft).__name__ == ("DFlashSpec" if variant == "dflash" else "Eagle3Spec"), job.draft
        plan = plan_memory(job, facts_from_folder(model))
        assert plan.fits and plan.free_before_load > 100 << 30 and plan.kv_pool_tokens > 0, plan.problems


def _imports_of(path: Path, siblings: set[str]) -> set[str]:
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out & siblings


def test_no_benchmark_script_imports_itself_back():
    """No import circle among benchmarks/*.py (function-level imports included): a script of the GPU
    check imported by another never imports it back through any chain."""
    mods = {p.stem: p for p in BENCHMARKS.glob("*.py")}
    graph = {m: _imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            assert m != start, f"import circle through benchmarks/{start}.py"
            if m not in seen:
                seen.add(m)
                todo += graph[m]


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
    """`gpu_check.py --device cpu --small`: every step passes (MPS skips itself: no GPU) and writes what
    the device run brings back: the real CLI co-located as one sharded rank (gloo) on the tiny
    DeepSeek-V3 (EAGLE-3) and the random Llama (DFlash), each exported with its memory report at
    stream start; DFlash and MLA EAGLE-3 served by SGLang. It sees only the H200 image's packages and the
    carried wheels (`image_only_env`): an import the wheel list misses fails here. The JIT compile is
    left to test_sglang_jit_builds_against_a_pip_layout_only_through_the_shim; the throughput step b
    runs on the device only."""
    out = tmp_path / "out"
    env = image_only_env()
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--small",
                           "--budget-s", "1500", "--no-compile", "--out", str(out)], capture_output=True, text=True, timeout=1700,
                          cwd=ROOT, env=env)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-4000:]
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("cli_deepseek", "pass"), ("cli_llama", "pass"), ("preflight", "pass"), ("c", "pass"), ("d", "pass"),
        ("e", "pass"), ("mps", "skipped"), ("kimi_steps", "pass"), ("trainer_checks", "pass")], summary["steps"]
    assert "needs a multi-GPU machine" in summary["steps"][6]["reason"]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_e2e.json", "gpu_kimi_shapes.json", "gpu_preflight.json", "gpu_cli_llama.json",
                                "gpu_cli_deepseek.json"} <= set(files), files
    for target, names in (("llama", ["llama dflash"]), ("deepseek", ["deepseek gpu"])):
        cli = json.loads((out / f"gpu_cli_{target}.json").read_text())
        assert [r["name"] for r in cli["runs"]] == names and cli["ok"], cli
        first = cli["runs"][0]
        assert first["steps"] == 4 and first["memory"]["plan"]["kv_pool_tokens"] > 0, first
        assert first["memory"]["engine"]["free_before_load"] > 0, first["memory"]  # SGLang's line, read from the log
        assert first["memory"]["sharded"], first["memory"]  # FSDP2 over a one-rank gloo group
    e2e = json.loads((out / "gpu_e2e.json").read_text())
    assert set(e2e["runs"]) == {"c", "d", "e"} and e2e["ok"]
    assert [r["method"] for r in e2e["e_spec"]] == ["dflash", "eagle3_mla"]
    for row in e2e["d_spec"] + e2e["e_spec"]:
        assert row["identical"] == row["prompts"] and row["verify_steps"] and row["replay_steps"], row
    assert e2e["c_slots"]["ok"]
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
