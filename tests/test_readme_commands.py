"""Every command README.md shows, tried as a new user would on a fresh clone: one empty
SPECFORGE_CACHE for all of them, so the first commands build the embedded targets (two commands at
a time: the co-located example's two ranks and another run ask for the same model folders at
once), with short settings (2 training samples of 64 tokens, no logger, a 1-prompt eval) so that
the whole README runs in about 5 minutes on 2 cores (~420 CPU seconds; the eval is a third).

How each command is tried is in COMMANDS, keyed by the command as the README spells it (comments
and line continuations removed); a command the README gains without an entry there, or an entry
the README lost, fails `test_every_readme_command_has_a_case`. The kinds:

- RUN: run as shown (`python` = this interpreter, `torchrun` = `python -m torch.distributed.run`),
  with short overrides (replacing the command's own value of a key it sets);
- PLAN: a GPU-profile training command, which cannot train here: `python -m specforge_k25.plan`
  with its Hydra overrides (the memory plan `train` runs before starting anything; the model path
  dropped, the plan then uses the built-in Kimi-K2.5 facts), which must fit (exit 0);
- OUTPUT: a line the README shows as printed by the dry run above it (`...` = elided text);
- COVERED: a CPU example another test's end-to-end run already runs (the co-located TP2 and
  pipeline layouts, tests/train/test_colocated.py): that run's settings must hold the command's
  own (train.batch_size aside, which the comparison there sets), so the example keeps running;
- SKIP: the install with the ~10-minute default run, the test suite itself, other projects' servers.

Commands that are the same once shortened (the two eval lines; the data-parallel and by-hand
torchrun lines of one GPU profile, as plans) run once and share the result.

Every output is checked for Python's resource_tracker warning (leaked semaphores or shared memory)
and, at the end, /dev/shm for what the runs left behind with no process holding it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from colocated_settings import COLOCATED, PIPELINE_COLOCATED

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHM = Path("/dev/shm")

RUN, PLAN, OUTPUT, SKIP, COVERED = "run", "plan", "output", "skip", "covered"
# the first test's setup runs every command (about 5 minutes on 2 idle cores; up to 16 on a loaded machine)
pytestmark = pytest.mark.timeout(2400)

SHORT_TRAIN = {"data.num_samples": "2", "data.heldout_samples": "1", "data.max_length": "64",
               "data.regen_max_new_tokens": "8", "train.logger": "none", "train.progress": "false"}
SHORT_EVAL = {"data.num_samples": "2", "data.heldout_samples": "1", "data.max_length": "64",  # as its training run
              "eval.num_prompts": "1", "eval.max_new_tokens": "4", "eval.prompt_sets": "[mtbench]",
              "eval.methods": "[nospec,trained]", "eval.chains": "[[3,1,4]]"}
EXPORT = "runs/a/export"  # the README's `outputs/<run>/export`: the export of the `train.out_dir=runs/a` run
CHAT = '{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}\n'


@dataclass
class Case:
    kind: str
    expect: str = ""  # text the output must contain
    short: dict = field(default_factory=dict)
    after: str = ""  # a command that must have run first (same chain)
    why: str = ""  # SKIP: the reason
    by: str = ""  # COVERED: the test whose run it is
    settings: list = field(default_factory=list)  # COVERED: that run's overrides


TRAIN = Case(RUN, "run summary", SHORT_TRAIN)
FITS = Case(PLAN, "fits")
# commands others run after
CHECKPOINTED = "python -m specforge_k25.train train.out_dir=runs/a train.checkpoint_every=50"
EVAL = "python -m specforge_k25.eval export_dir=outputs/<run>/export"
DRY_RUN_DP = ("python launch/multinode.py --nodes 2 --master-addr 10.0.0.1 --dry-run -- +hw=rtxpro6000x8 "
              "target=kimi_k25 target.path=/models/Kimi-K2.5")
DRY_RUN_TP16 = ("python launch/multinode.py --nodes 2 --master-addr 10.0.0.1 --target-nodes 2 --dry-run -- "
                "+hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 hw.trainer_layout=dedicated "
                "hw.target_tp=16")
TORCHRUN_DP = "torchrun --standalone --nproc-per-node 2 -m specforge_k25.train hw.target_replicas=2 train.batch_size=1"
COMMANDS: dict[str, Case] = {
    # Fresh machine
    "bash scripts/install.sh && .venv/bin/python -m specforge_k25.train":
        Case(SKIP, why="the install this suite runs in, then the ~10-minute default run, whose code path every "
                       "`python -m specforge_k25.train` case below runs with short settings"),
    "bash scripts/install.sh && .venv/bin/python -m pytest -q": Case(SKIP, why="the test suite itself"),
    # Using it
    "python -m specforge_k25.train --help": Case(RUN, "Fields (override as group.field=value)"),
    "python -m specforge_k25.train target=tiny_deepseek": TRAIN,
    "python -m specforge_k25.train data.num_samples=50 train.lr=3e-4 train.logger=none": TRAIN,
    "python -m specforge_k25.train data.source=jsonl data.path=my_chats.jsonl": TRAIN,
    CHECKPOINTED: TRAIN,
    CHECKPOINTED + " train.resume=auto": Case(RUN, "resuming from", SHORT_TRAIN, after=CHECKPOINTED),
    "python -m specforge_k25.train data.regenerate=true": TRAIN,
    "python -m specforge_k25.train draft=dflash data.regenerate=true": TRAIN,
    # Kimi-K2.5: the memory plan
    "python -m specforge_k25.plan +hw=rtxpro6000x8 target=kimi_k25 draft=kimi": Case(RUN, "fits"),
    "python -m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5": FITS,
    # Long context
    "python -m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 draft=kimi hw.context_parallel=8 "
    "data.max_length=16384": FITS,
    "python -m specforge_k25.train +hw=b300x8 target=kimi_k25 draft=kimi hw.context_parallel=4 "
    "data.max_length=65536 hw.mem_fraction_static=0.57": FITS,
    # Trainer layouts
    "python -m specforge_k25.train +hw=b300x8 target=kimi_k25 draft=kimi train.out_dir=runs/a": FITS,
    "torchrun --nproc-per-node 8 -m specforge_k25.train +hw=b300x8 target=kimi_k25 draft=kimi train.out_dir=runs/a":
        FITS,
    "torchrun --nproc-per-node 2 -m specforge_k25.train +hw=b300x8 hw.trainer_layout=dedicated target=kimi_k25 "
    "draft=kimi": FITS,
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m "
    "specforge_k25.train +hw=b300x8 target=kimi_k25 draft=kimi train.out_dir=/shared/runs/a": FITS,
    "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m "
    "specforge_k25.train +hw=b300x8 target=kimi_k25 draft=kimi train.out_dir=/shared/runs/a": FITS,
    "python -m specforge_k25.train target=tiny_deepseek hw.target_tp=2 hw.trainer_layout=colocated "
    "train.batch_size=1": Case(COVERED, by="tests/train/test_colocated.py::colocated_runs", settings=COLOCATED),
    TORCHRUN_DP: TRAIN,
    "torchrun --nproc-per-node 8 -m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 draft=kimi hw.target_pp=8 "
    "hw.target_tp=1 hw.mem_fraction_static=0.87": FITS,
    "python -m specforge_k25.train target=tiny_deepseek hw.target_pp=2 hw.trainer_layout=colocated "
    "train.batch_size=1": Case(COVERED, by="tests/train/test_colocated.py::"
                                          "test_colocated_ranks_beside_two_pipeline_stages_equal_one_dedicated_rank",
                               settings=PIPELINE_COLOCATED),
    # Serving the export: other projects' servers
    "python -m sglang.launch_server --model-path <target> --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path outputs/<run>/export --speculative-num-steps 3 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 4": Case(SKIP, why="SGLang's server (the eval below loads the export into an "
                                                       "SGLang engine with the same speculative settings)"),
    'vllm serve <target> --speculative-config {"method": "eagle3", "model": "outputs/<run>/export", '
    '"num_speculative_tokens": 3}': Case(SKIP, why="vLLM is not installed here"),
    # Draft methods
    "python -m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 draft=kimi_mla "
    "train.out_dir=runs/mla": FITS,
    "python -m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 draft=kimi_dflash "
    "target.aux_layers=[2,13,25,36,48,59] train.optimizer_device=cpu hw.target_prefill_chunk=8192 "
    "data.max_length=4864 data.regenerate=true": FITS,
    "python -m specforge_k25.train +hw=b300x8 target=kimi_k25 target.path=/models/Kimi-K2.5 draft=kimi_dflash "
    "target.aux_layers=[2,13,25,36,48,59] data.max_length=65536 hw.mem_fraction_static=0.66 "
    "data.regenerate=true": FITS,
    "python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH "
    "--speculative-draft-model-path outputs/<run>/export --speculative-num-steps 1 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 8": Case(SKIP, why="SGLang's server (tests/eval/test_eval_dflash.py serves a "
                                                      "DFlash export in an SGLang engine with these settings)"),
    'vllm serve <target> --speculative-config {"method": "dflash", "model": "outputs/<run>/export", '
    '"num_speculative_tokens": 7}': Case(SKIP, why="vLLM is not installed here"),
    # Acceptance length
    EVAL: Case(RUN, "acceptance length", SHORT_EVAL, after=CHECKPOINTED),
    "python -m specforge_k25.eval export_dir=... eval.num_prompts=20 eval.chains=[[3,1,4]]":
        Case(RUN, "acceptance length", SHORT_EVAL, after=EVAL),
    "python -m specforge_k25.eval --help": Case(RUN, "eval.num_prompts"),
    # Will this head pay on my node? (the run's own folder stands in for outputs/<run>)
    "python -m specforge_k25.serving +hw=rtxpro6000x8 serving.run=outputs/<run>":
        Case(RUN, "predicted decode speedup", {"serving.run": "runs/a"}, after=CHECKPOINTED),
    "python -m specforge_k25.serving +hw=b300x8 serving.acceptance=[0.8,0.7,0.6] serving.method=eagle3 "
    "serving.out=p.json": Case(RUN, "num_speculative_tokens_per_batch_size"),
    # Multi-node
    DRY_RUN_DP: Case(RUN, "# node 1 of 2"),
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29500 -m "
    "specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5":
        Case(OUTPUT, after=DRY_RUN_DP),
    DRY_RUN_TP16: Case(RUN, "# node 1 of 2"),
    "torchrun --nnodes 1 --node-rank 0 --nproc-per-node 1 ... -m specforge_k25.train ... hw.target_tp=16 "
    "hw.target_nnodes=2 hw.target_node_rank=0 hw.target_dist_init_addr=10.0.0.1:29600":
        Case(OUTPUT, after=DRY_RUN_TP16),
    "python -m specforge_k25.train.tp_node ... hw.target_tp=16 hw.target_nnodes=2 hw.target_node_rank=1 "
    "hw.target_dist_init_addr=10.0.0.1:29600":
        Case(OUTPUT, after=DRY_RUN_TP16),
    # MPS on a co-located node: NVIDIA's daemon, on GPUs only
    "export CUDA_MPS_PIPE_DIRECTORY=$PWD/.mps/pipe CUDA_MPS_LOG_DIRECTORY=$PWD/.mps/log":
        Case(SKIP, why="MPS: a GPU node's daemon"),
    "nvidia-cuda-mps-control -d": Case(SKIP, why="MPS: a GPU node's daemon"),
    "torchrun ... -m specforge_k25.train ...": Case(SKIP, why="the launch between MPS on and off (elided)"),
    "echo quit | nvidia-cuda-mps-control": Case(SKIP, why="MPS: a GPU node's daemon"),
}


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash blocks: continuation lines joined, comments dropped,
    each as the shell would split it, joined by single spaces."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        pending = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            words = shlex.split(pending + line, comments=True)
            pending = ""
            if words:
                commands.append(" ".join(words))
    return commands


def test_every_readme_command_has_a_case():
    shown = readme_commands(README.read_text())
    assert len(shown) == len(set(shown))
    assert [c for c in shown if c not in COMMANDS] == [], "README commands this test does not try"
    assert [c for c in COMMANDS if c not in shown] == [], "cases for commands the README no longer shows"


def test_readme_serving_commands_are_each_methods_servings():
    """The SGLang and vLLM commands the README shows serve each method as `DraftMethod.servings` says
    (what the eval serves and replays), flag for flag; its vLLM command serves the same setting as
    its SGLang one (DFlash: num_speculative_tokens = the SGLang block size - 1)."""
    from specforge_k25.draft.registry import METHODS

    sglang, vllm = {}, {}
    for command in readme_commands(README.read_text()):
        words = command.split(" ")
        if words[:3] == ["python", "-m", "sglang.launch_server"]:
            flags = dict(zip(words[3::2], words[4::2]))
            method = {"EAGLE3": "eagle3", "DFLASH": "dflash"}[flags["--speculative-algorithm"]]
            chain = [int(flags["--speculative-num-steps"]), int(flags["--speculative-eagle-topk"]),
                     int(flags["--speculative-num-draft-tokens"])]
            sglang[method] = METHODS[method].servings([chain])[0]
            shown = {k[2:].replace("-", "_"): v for k, v in flags.items() if k.startswith("--speculative-")
                     and k != "--speculative-draft-model-path"}
            assert shown == {k: str(v) for k, v in sglang[method].sglang_args.items()}, command
        elif words[:2] == ["vllm", "serve"]:
            config = json.loads(command.split("--speculative-config ", 1)[1])  # readme_commands: the JSON whole
            vllm[config.pop("method")] = config
    assert set(sglang) == set(vllm) == {"eagle3", "dflash"}
    for method, serving in sglang.items():
        expected = {k: v for k, v in serving.vllm_speculative_config.items() if k != "method"}
        assert {k: v for k, v in vllm[method].items() if k != "model"} == expected, method
    assert vllm["dflash"]["num_speculative_tokens"] == sglang["dflash"].draft_tokens - 1


# what a COVERED run may set otherwise than the README's example (the comparison's batch)
COVERED_MAY_DIFFER = {"train.batch_size"}


@pytest.mark.parametrize("command", [c for c, case in COMMANDS.items() if case.kind == COVERED])
def test_readme_example_is_what_another_test_runs(command):
    """The covering run is `python -m specforge_k25.train` with every override of the example, at
    the example's value (COVERED_MAY_DIFFER aside), and no other layout (hw.*) setting."""
    case = COMMANDS[command]
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "specforge_k25.train"], words
    settings = dict(w.split("=", 1) for w in case.settings)
    for key, value in (w.split("=", 1) for w in words[3:]):
        assert key in settings, f"{case.by} does not set {key} (the README's {key}={value})"
        assert settings[key] == value or key in COVERED_MAY_DIFFER, (key, value, settings[key], case.by)
    shown = dict(w.split("=", 1) for w in words[3:])
    layout = {k: v for k, v in settings.items() if k.startswith("hw.")}
    assert layout == {k: v for k, v in shown.items() if k.startswith("hw.")}, (layout, case.by)  # the same layout


def _argv(command: str, case: Case) -> list[str]:
    """What runs for a RUN or PLAN case, in the work folder."""
    words = shlex.split(command)
    if case.kind == PLAN:  # the command's Hydra overrides (after the module name), minus the model folder
        overrides = words[words.index("specforge_k25.train") + 1:]
        return [sys.executable, "-m", "specforge_k25.plan", *[w for w in overrides if not w.startswith("target.path=")]]
    if words[0] == "python":
        words = [sys.executable, *words[1:]]
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    if words[1] == "launch/multinode.py":
        words[1] = str(ROOT / words[1])
    words = [f"export_dir={EXPORT}" if w.startswith("export_dir=") else w for w in words]
    short = dict(case.short)
    for i, w in enumerate(words):  # the command's own value of a shortened key gives way
        key = w.split("=", 1)[0]
        if "=" in w and key in short:
            words[i] = f"{key}={short.pop(key)}"
    return words + [f"{k}={v}" for k, v in short.items()]


def _same_command_key(argv: list[str]) -> tuple:
    """Two argvs with the same words in the same order, overrides in any order, run the same."""
    return tuple(w for w in argv if "=" not in w), tuple(sorted(w for w in argv if "=" in w))


def _shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def _held(names: set[str]) -> set[str]:
    """Those of the /dev/shm `names` a live process has open or mapped (a running engine's or
    another test's, not a leak; a named semaphore is only mapped)."""
    held = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            held.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
            held.update(line.split(None, 5)[-1].strip() for line in (proc / "maps").read_text().splitlines()
                        if "/dev/shm/" in line)
        except OSError:  # gone, or not ours to read
            continue
    return {name for name in names if f"/dev/shm/{name}" in held}


def _run(argv: list[str], cwd: Path, env: dict, timeout_s: float = 900) -> tuple[int, str, float, float]:
    """(exit status, stdout + stderr, seconds, CPU seconds of the command and the children it waited for)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout stops all it started
    timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        output = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, output, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


@dataclass
class Result:
    argv: list[str]
    code: int
    output: str
    seconds: float
    cpu_s: float
    ran_as: str  # the command that ran (itself, or an earlier one that is the same with short settings)


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """Runs the RUN and PLAN cases (two at a time, dependent ones after their prerequisite) in one
    work folder with one empty cache; a command that is the same as an earlier one once shortened
    runs once. Returns ({command: Result}, seconds, /dev/shm entries left, the cache, the work folder)."""
    work, cache = tmp_path_factory.mktemp("readme"), tmp_path_factory.mktemp("cache")
    (work / "my_chats.jsonl").write_text(CHAT * 3)
    env = {**os.environ, "SPECFORGE_CACHE": str(cache), "WANDB_MODE": "disabled"}
    env.pop("PYTHONWARNINGS", None)  # the resource tracker's warnings must show
    tried = [c for c, case in COMMANDS.items() if case.kind in (RUN, PLAN)]
    argvs = {c: _argv(c, COMMANDS[c]) for c in tried}
    first: dict[tuple, str] = {}
    ran_as = {c: first.setdefault(_same_command_key(argvs[c]), c) for c in tried}
    chains = [[c] for c in tried if ran_as[c] == c and not COMMANDS[c].after]
    for c in tried:  # a dependent command joins its prerequisite's chain
        if ran_as[c] == c and COMMANDS[c].after:
            next(ch for ch in chains if ran_as[COMMANDS[c].after] in ch).append(c)
    # the longest chain (train, resume, eval) and the data-parallel example (two ranks) first:
    # three processes then build the embedded targets from the empty cache at once
    chains.sort(key=lambda ch: (-len(ch), "torchrun --standalone" not in ch[0]))
    results: dict[str, Result] = {}

    def chain(commands: list[str]):
        for c in commands:
            results[c] = Result(argvs[c], *_run(argvs[c], work, env), ran_as=c)

    before, t0 = _shm_entries(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(chain, ch) for ch in chains]:
            future.result()
    seconds = time.perf_counter() - t0
    left = _shm_entries() - before
    for c in tried:
        results[c] = dataclasses.replace(results[ran_as[c]], ran_as=ran_as[c])
    return results, seconds, left - _held(left), cache, work


@pytest.mark.e2e
@pytest.mark.engine
@pytest.mark.parametrize("command", [c for c, case in COMMANDS.items() if case.kind in (RUN, PLAN)])
def test_readme_command_runs(readme_runs, command):
    r = readme_runs[0][command]
    shown = " ".join(shlex.quote(a) for a in r.argv) + (f"\n(ran as: {r.ran_as})" if r.ran_as != command else "")
    assert r.code == 0, f"{shown}\nexit {r.code}\n{r.output[-6000:]}"
    assert COMMANDS[command].expect in r.output, f"{shown}\n{r.output[-6000:]}"
    assert "resource_tracker" not in r.output and "leaked" not in r.output, f"{shown}\n{r.output[-6000:]}"


@pytest.mark.e2e
@pytest.mark.engine
@pytest.mark.parametrize("command", [c for c, case in COMMANDS.items() if case.kind == OUTPUT])
def test_readme_shows_what_the_dry_run_prints(readme_runs, command):
    printed = readme_runs[0][COMMANDS[command].after].output.splitlines()
    pattern = re.compile(".*?".join(re.escape(part.strip()) for part in command.split("...")))
    assert any(pattern.fullmatch(line) for line in printed), "\n".join(printed)


@pytest.mark.e2e
@pytest.mark.engine
def test_readme_runs_leave_no_shared_memory_and_build_each_target_once(readme_runs):
    results, seconds, left, cache, _ = readme_runs
    ran = {r.ran_as: r for r in results.values()}
    for r in sorted(ran.values(), key=lambda r: -r.cpu_s):
        print(f"{r.seconds:6.0f} s {r.cpu_s:6.0f} CPU s  {r.ran_as}")
    print(f"{len(ran)} commands for the README's {len(results)}: {seconds:.0f} s, "
          f"{sum(r.cpu_s for r in ran.values()):.0f} CPU s")
    # exact on a machine running nothing else (CI); another program's leftovers would show here too
    assert left == set(), "appeared in /dev/shm while the README's commands ran, and no process holds them"
    models = cache / "models"
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == [
        "SmolLM2-135M-Instruct", "tiny-deepseek-v3-L8-H128-s0"]
    assert not list(models.glob(".*.build-*")), "a build's staging folder left behind"


@pytest.mark.e2e
@pytest.mark.engine
def test_readme_torchrun_run_has_rank_0_alone_print_and_write(readme_runs):
    """The data-parallel example under torchrun: two ranks, two SGLang target processes; rank 0
    alone prints the plan and the summary and writes the run folder, which holds both ranks' work."""
    results, _, _, _, work = readme_runs
    r = results[TORCHRUN_DP]
    assert r.output.count("run plan") == 1 and r.output.count("run summary") == 1, r.output[-6000:]
    runs = [p.parent for p in work.glob("outputs/**/summary.json")
            if "hw.target_replicas=2" in (p.parent / ".hydra" / "overrides.yaml").read_text()]
    assert len(runs) == 1, runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    samples = int(SHORT_TRAIN["data.num_samples"])
    assert summary["trainer_ranks"] == 2 and summary["samples_trained"] == samples and summary["steps"] == samples // 2
    assert summary["disk"]["hidden_state_bytes_on_disk"] == 0 and summary["eval"]["end"]["positions"] > 0
    records = [line for line in (runs[0] / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]
    assert len(records) == summary["steps"] and (runs[0] / "export" / "model.safetensors").is_file()
