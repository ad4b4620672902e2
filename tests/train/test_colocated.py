"""Co-located trainer ranks (hw.trainer_layout=colocated): the token-balanced shares, the layout
rules, and the real CLI under torchrun (SGLang TP2 target on the tiny DeepSeek, one trainer rank
beside each TP rank, the draft sharded with FSDP2 over gloo) against one dedicated trainer rank
reading the same TP2 target with the same global batch."""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from specforge_k25.config import HwConfig
from specforge_k25.plan.budget import node_layout
from specforge_k25.setup.layout import World, check_layout
from specforge_k25.train.distributed import Ranks, balanced_shares

from colocated_settings import COLOCATED, COMMON, PIPELINE_COLOCATED
from rank_runs import assert_same_evals, checkpoint_diffs, max_rel_diff, rank_env, resume_from_copy, run_side_by_side

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ shares and layout
def test_balanced_shares_known_cases():
    assert balanced_shares([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]  # 5 vs 5 tokens
    assert balanced_shares([3, 3, 2, 2, 2], 2) == [[0, 2, 4], [1, 3]]  # LPT: 7 vs 5, positions ascending
    assert balanced_shares([4], 2) == [[0], []]  # a short batch leaves a rank empty
    assert balanced_shares([], 3) == [[], [], []]


def test_colocated_shares_cover_the_replica_batch_once_and_balance_tokens():
    sizes = {10: 50, 11: 7, 12: 30, 13: 22, 20: 1, 21: 1, 22: 1, 23: 1}
    batch = [10, 11, 12, 13, 20, 21, 22, 23]  # global batch: 2 replicas x 2 ranks x batch_size 2
    shares = [Ranks(rank=r, world=4, per_replica=2).share(batch, 2, sizes) for r in range(4)]
    assert sorted(shares[0] + shares[1]) == [10, 11, 12, 13] and sorted(shares[2] + shares[3]) == [20, 21, 22, 23]
    assert [sum(sizes[i] for i in s) for s in shares] == [57, 52, 2, 2]
    # dedicated (one rank per replica): the contiguous slices as before
    assert [Ranks(rank=r, world=2).share(batch[:4], 2) for r in range(2)] == [[10, 11], [12, 13]]


def test_colocated_layout_rules():
    hw = HwConfig(name="b300x8", device="cuda", num_gpus=8, target_tp=4, target_replicas=2, trainer_layout="colocated")
    assert node_layout(hw).ranks_per_node == 8
    assert [node_layout(hw).rank_gpus(r) for r in (0, 3, 4, 7)] == [(0, 0), (3, 0), (4, 4), (7, 4)]
    check_layout(hw, World(rank=5, size=8, local_rank=5, local_size=8))
    with pytest.raises(ValueError, match="2 replica\\(s\\) x TP 4 = 8 trainer ranks.*--nproc-per-node 8"):
        check_layout(hw, World(size=2, local_size=2))
    with pytest.raises(ValueError, match="one node"):
        check_layout(HwConfig(target_tp=2, target_nnodes=2, trainer_layout="colocated"), World(size=1, local_size=1))
    with pytest.raises(ValueError, match="trainer_layout"):
        check_layout(HwConfig(trainer_layout="sideways"), World())


# ------------------------------------------------------------------ two co-located ranks == one dedicated rank
# COMMON, COLOCATED, PIPELINE_COLOCATED: tests/fixtures/colocated_settings.py (the README's CPU
# examples of these layouts are run here, with these settings)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _cli(run_dir: Path, overrides: list[str], nproc: int = 1) -> list[str]:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    return [*launch, "-m", "specforge_k25.train", *overrides, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir}/hydra"]


@pytest.fixture(scope="module")
def colocated_runs(tiny_deepseek_path, tmp_path_factory):
    """One dedicated rank x batch 4 and two co-located ranks x batch 2, TP2 each, side by side; the
    co-located run launched as `python -m specforge_k25.train`, which starts its ranks with torchrun."""
    root = tmp_path_factory.mktemp("colocated")
    one, two = root / "dedicated", root / "colocated"
    # the co-located run as plain python: it starts torchrun itself
    logs = run_side_by_side([_cli(one, [*COMMON, "train.batch_size=4"]), _cli(two, COLOCATED)], timeout=900)
    return one, two, logs


@pytest.mark.e2e
def test_two_colocated_ranks_equal_one_dedicated_rank(colocated_runs):
    one, two, logs = colocated_runs
    assert "2 trainer ranks (one beside each of the 2 TP ranks of 1 replica(s)); starting them with torchrun" in logs[1]
    assert "torchrun" not in logs[0]
    assert "2 co-located trainer ranks, one beside each TP rank of 1 replica(s)" in logs[1]  # rank 0's plan
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s2["trainer_ranks"] == 2 and s1["trainer_ranks"] == 1
    for key in ("steps", "samples_trained", "tokens_trained"):
        assert s1[key] == s2[key], key
    assert s1["steps"] == 4 and s1["samples_trained"] == 26
    assert s2["disk"]["hidden_state_bytes_on_disk"] == 0
    # what benchmarks/colocated.py reads from each layout's summary
    assert all(finite(s[k]) for s in (s1, s2) for k in ("train_wall_s", "tokens_per_s", "stream_wait_frac"))
    assert json.loads((two / "checkpoints" / "step_00000004" / "state.json").read_text()
                      )["fingerprint"]["trainer_layout"] == "colocated"

    diffs = checkpoint_diffs(one, two)
    ckpts = sorted(p.name for p in (one / "checkpoints").iterdir())
    assert len(diffs) == len(ckpts) + 1 == 5
    print("max relative weight difference, dedicated vs co-located:", diffs)
    assert max(diffs.values()) < 1e-6, diffs
    first = load_file(one / "checkpoints" / ckpts[0] / "draft.safetensors")
    assert max_rel_diff(first, load_file(one / "checkpoints" / ckpts[-1] / "draft.safetensors")) > 1e-2
    # AdamW's state, gathered from the shards into the one-rank format (keyed by parameter name)
    o1 = load_file(one / "checkpoints" / ckpts[-1] / "optimizer.safetensors")
    o2 = load_file(two / "checkpoints" / ckpts[-1] / "optimizer.safetensors")
    assert sum(k.endswith(".exp_avg") for k in o2) == sum(k.endswith(".exp_avg") for k in o1) > 0

    assert_same_evals(s1, s2)


@pytest.mark.e2e
def test_colocated_ranks_beside_two_pipeline_stages_equal_one_dedicated_rank(colocated_runs, tmp_path):
    """hw.target_pp=2 hw.target_tp=1: trainer rank 0 beside stage 0 (which holds no states: the last
    stage sends it its share), rank 1 beside stage 1. Against the dedicated rank reading the TP2
    target: the pipeline's states are the one-process engine's (test_target_pp.py), TP2's differ
    from them by fp32 rounding, so the weights agree to that rounding, not bit for bit."""
    one, _, _ = colocated_runs
    pp = tmp_path / "pp"
    logs = run_side_by_side([_cli(pp, PIPELINE_COLOCATED)], timeout=900)
    assert "one beside each of the 1 TP ranks x 2 pipeline stages of 1 replica(s)" in logs[0]
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, pp))
    assert s2["trainer_ranks"] == 2 and s2["samples_trained"] == s1["samples_trained"] == 26
    assert s2["tokens_trained"] == s1["tokens_trained"]
    ckpts = sorted(p.name for p in (one / "checkpoints").iterdir())
    diffs = {c: max_rel_diff(load_file(one / "checkpoints" / c / "draft.safetensors"),
                              load_file(pp / "checkpoints" / c / "draft.safetensors")) for c in ckpts}
    print("max relative weight difference, dedicated (TP2) vs co-located beside PP2:", diffs)
    assert max(diffs.values()) < 1e-5, diffs  # measured 9.6e-7 at step 4


@pytest.mark.e2e
def test_colocated_resume_from_its_gathered_checkpoint_is_bit_identical(colocated_runs, tmp_path):
    _, two, _ = colocated_runs
    run = tmp_path / "resumed"
    assert resume_from_copy(two, run, _cli(run, [*COLOCATED, "train.resume=auto"], nproc=2))["steps"] == 4
    a, b = load_file(two / "export" / "model.safetensors"), load_file(run / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("draft.safetensors", "optimizer.safetensors"):
        a = load_file(two / "checkpoints" / "step_00000004" / name)
        b = load_file(run / "checkpoints" / "step_00000004" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "rng.torch"), name


# hw.context_parallel=2: both co-located ranks train on all 4 sequences of each global batch
# (train.batch_size is per group), each on its half of every sequence's positions
CONTEXT_PARALLEL = [*COMMON, "hw.trainer_layout=colocated", "hw.context_parallel=2", "train.batch_size=4"]


@pytest.mark.e2e
def test_context_parallel_ranks_equal_one_dedicated_rank_and_resume_bit_exact(colocated_runs, tmp_path):
    """Each TP rank streams its trainer rank's window of every sequence (make_batch refuses other
    rows) and the two ranks exchange q/k/v for attention: the updates equal the dedicated rank's
    on whole sequences (measured 1.8e-7 relative after 4 steps); a resume from step 2 ends on the
    uninterrupted run's bits."""
    one, _, _ = colocated_runs
    run, resumed = tmp_path / "cp", tmp_path / "cp_resumed"
    log = run_side_by_side([_cli(run, CONTEXT_PARALLEL)], timeout=900)[0]
    assert "in 1 group(s) of 2 that split every sequence's positions (hw.context_parallel" in log  # rank 0's plan
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["samples_trained"] == 26
    ckpts = sorted(p.name for p in (one / "checkpoints").iterdir())
    diffs = {c: max_rel_diff(load_file(one / "checkpoints" / c / "draft.safetensors"),
                              load_file(run / "checkpoints" / c / "draft.safetensors")) for c in ckpts}
    print("max relative weight difference, dedicated vs context parallel:", diffs)
    assert len(diffs) == 4 and max(diffs.values()) < 1e-6, diffs
    assert json.loads((run / "checkpoints" / ckpts[-1] / "state.json").read_text())["fingerprint"]["context_parallel"] == 2

    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    assert _resume_to_end(resumed, CONTEXT_PARALLEL)["resumed_from"].endswith("step_00000002")
    for name in ("draft.safetensors", "optimizer.safetensors"):
        a = load_file(run / "checkpoints" / "step_00000004" / name)
        b = load_file(resumed / "checkpoints" / "step_00000004" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "rng.torch"), name


# a run long enough to be killed mid-way: 32 training samples x 2 epochs (16 steps of 4), a checkpoint every 2 steps
LONGER = [*COLOCATED, "data.num_samples=32", "train.epochs=2", "train.checkpoint_every=2", "train.lr=1e-3",
          "train.grad_clip=0.5"]
LONGER_SAMPLES = 2 * 32


def _signal_when(run: Path, overrides: list[str], ready, victim, sig=signal.SIGKILL) -> str:
    """Start a co-located run; once `ready(launcher_pid)` holds, send `sig` to
    `victim(launcher_pid)`; the launch must end within 30 s of it and leave no process behind
    (TP ranks and trainer ranks all gone). Returns its output."""
    proc = subprocess.Popen(_cli(run, overrides, nproc=2), env=rank_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not ready(proc.pid) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-5000:]
            time.sleep(0.2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        victim(proc.pid).send_signal(sig)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        assert time.monotonic() - sent < 30, out[-5000:]
    finally:
        proc.kill()
    assert proc.returncode != 0
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    return out


def _checkpointed(run: Path):
    return lambda _pid: bool(list(run.glob("checkpoints/step_*")))


def _trained_steps(run: Path, n: int):
    """Ready once `n` more optimizer steps than now are logged (metrics.jsonl is appended to on resume)."""
    def logged() -> int:
        metrics = run / "metrics.jsonl"
        return sum('"train/loss"' in line for line in metrics.read_text().splitlines()) if metrics.is_file() else 0
    before = logged()
    return lambda _pid: logged() >= before + n


def _tp_ranks_started(launcher_pid: int) -> bool:
    try:
        tree = psutil.Process(launcher_pid).children(recursive=True)
        return sum("spawn_main" in " ".join(p.cmdline()) for p in tree) == 2
    except psutil.Error:
        return False


def _resume_to_end(run: Path, overrides: list[str]) -> dict:
    """The same launch line with train.resume=auto; its summary."""
    resumed = subprocess.run(_cli(run, [*overrides, "train.resume=auto"], nproc=2), env=rank_env(), cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-5000:]
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def interrupted_run(tiny_deepseek_path, tmp_path_factory):
    """One co-located run interrupted twice, then finished: SIGKILL the TP rank beside trainer
    rank 1 after the first checkpoint; resume with periodic checkpoints off and SIGTERM the launcher
    after two more steps; resume to the end. Returns (run dir, the three outputs, the checkpoints
    the kill left, the SIGTERM checkpoint or None, the final summary)."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    killed = _signal_when(run, LONGER, _checkpointed(run), lambda pid: _tp_process_of_trainer_rank(pid, 1))
    saved = sorted(p.name for p in run.glob("checkpoints/step_*"))
    no_periodic = [o for o in LONGER if not o.startswith("train.checkpoint_every=")] + ["train.checkpoint_every=0"]
    stopped = _signal_when(run, [*no_periodic, "train.resume=auto"], _trained_steps(run, 2), psutil.Process,
                           signal.SIGTERM)
    new = [p for p in run.glob("checkpoints/step_*") if p.name not in saved and (p / "state.json").is_file()]
    summary = _resume_to_end(run, LONGER)
    return run, (killed, stopped), saved, (new[0] if len(new) == 1 else None), summary


@pytest.mark.e2e
def test_killed_colocated_tp_rank_is_named_with_progress_saved(interrupted_run):
    """SIGKILL the TP rank beside trainer rank 1 after the first checkpoint: the launch ends within
    30 s, leaves no process behind (`_signal_when`), names that TP rank, and points at the saved
    checkpoint."""
    _, (out, _), saved, _, _ = interrupted_run
    assert "TP rank 1 of 2" in out and "died" in out, out[-5000:]
    assert "progress saved" in out and saved and saved[-1] in out, out[-5000:]


@pytest.mark.e2e
def test_sigterm_to_torchrun_saves_the_sharded_state_together(interrupted_run):
    """SIGTERM to the launcher of the resumed run, which passes it to each trainer rank's process
    group (its TP rank included): the TP ranks keep serving, the trainer ranks agree to stop at the
    same batch, gather their shards and save (periodic checkpoints off, so the one new checkpoint
    is the SIGTERM one), and nothing is left running."""
    _, (_, out), saved, stopped_at, _ = interrupted_run
    assert "resuming from" in out and "stopped by SIGTERM; checkpoint: " in out, out[-5000:]
    assert stopped_at is not None and f"checkpoint: {stopped_at}" in out, out[-5000:]
    assert int(stopped_at.name.split("_")[1]) >= int(saved[-1].split("_")[1]) + 2


@pytest.mark.e2e
def test_a_killed_then_stopped_run_resumes_to_the_end(interrupted_run):
    """The same launch line with train.resume=auto continues from the SIGTERM checkpoint and trains
    every sample of the schedule."""
    _, _, _, stopped_at, summary = interrupted_run
    assert stopped_at is not None and Path(summary["resumed_from"]) == stopped_at
    # 2 ranks x batch 2 x grad_accum 2 = 8 samples per optimizer step
    assert summary["samples_trained"] == LONGER_SAMPLES and summary["steps"] == LONGER_SAMPLES // 8


@pytest.mark.e2e
def test_killed_colocated_trainer_rank_is_named(tiny_deepseek_path, tmp_path):
    """SIGKILL trainer rank 1 itself after the first checkpoint: the launch ends within 30 s,
    names the dead rank and leaves no target process behind (the resume of a killed run is
    test_a_killed_then_stopped_run_resumes_to_the_end's)."""
    run = tmp_path / "killed"
    out = _signal_when(run, LONGER, _checkpointed(run), lambda pid: _trainer_rank(pid, 1))
    assert "local_rank: 1" in out and "Signal 9 (SIGKILL)" in out, out[-5000:]
    assert list(run.glob("checkpoints/step_*"))


@pytest.mark.e2e
def test_sigterm_before_the_first_step_stops_cleanly(tiny_deepseek_path, tmp_path):
    """SIGTERM while the TP ranks start: nothing to save, and the run says so (no traceback of ours)."""
    run = tmp_path / "early"
    out = _signal_when(run, LONGER, _tp_ranks_started, psutil.Process, signal.SIGTERM)
    assert "stopped by SIGTERM; checkpoint: none (no optimizer step yet" in out, out[-5000:]
    assert "StreamInterrupted" not in out and "StreamError" not in out, out[-5000:]
    assert not list(run.glob("checkpoints/step_*"))


def _trainer_rank(launcher_pid: int, rank: int) -> psutil.Process:
    for trainer in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if trainer.environ().get("LOCAL_RANK") == str(rank) and "specforge_k25.train" in " ".join(trainer.cmdline()):
                return trainer
        except psutil.Error:
            continue
    raise AssertionError(f"no trainer rank {rank} found")


def _tp_process_of_trainer_rank(launcher_pid: int, rank: int) -> psutil.Process:
    """The target process a trainer rank started (torchrun -> trainer ranks -> their spawned TP rank)."""
    trainer = _trainer_rank(launcher_pid, rank)
    return next(c for c in trainer.children() if "spawn_main" in " ".join(c.cmdline()))


@pytest.mark.e2e
def test_colocated_regeneration_trains_the_same_answers_as_dedicated(tiny_deepseek_path, tmp_path):
    """data.regenerate with co-located ranks: TP rank 0 decodes, every TP rank prefills prompt +
    answer and hands its own trainer rank its share. Greedy answers of the same TP2 engine, so the
    two layouts train on the same conversations: the same tokens and positions, nothing on disk."""
    # one held-out sample: trainer rank 1 has no share of an evaluation batch and must still join
    # FSDP's all-gathers (a rank that skipped the forward left the collectives out of step)
    regen = ["target=tiny_deepseek", "hw.target_tp=2", "data.regenerate=true", "data.regen_max_new_tokens=8",
             "data.num_samples=12", "data.heldout_samples=1", "data.max_length=64", "draft.vocab_size=1024",
             "train.dist_timeout_s=120", "train.progress=false", "train.logger=none"]
    runs = {"dedicated": [*regen, "train.batch_size=4"],
            "colocated": [*regen, "hw.trainer_layout=colocated", "train.batch_size=2"]}
    summaries = {}
    for name, overrides in runs.items():
        out = subprocess.run(_cli(tmp_path / name, overrides), env=rank_env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    d, c = summaries["dedicated"], summaries["colocated"]
    assert c["trainer_ranks"] == 2 and c["samples_trained"] == d["samples_trained"] == 12
    assert c["tokens_trained"] == d["tokens_trained"] > 12 * 8
    assert c["eval"]["end"]["positions"] == d["eval"]["end"]["positions"] > 0
    assert c["disk"]["hidden_state_bytes_on_disk"] == 0
    rows = [json.loads(x) for x in (tmp_path / "colocated" / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(r["sample"] for r in rows if r["kind"] == "train") == list(range(12))  # both ranks' shares
    assert c["regeneration"] == d["regeneration"]
