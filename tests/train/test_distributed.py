"""Data-parallel trainer ranks (train/distributed.py): the loss normalisation over ranks in float64,
the rank layout checks, and two ranks under torchrun (gloo, CPU, HF target) against one rank with
the doubled batch."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge_k25.config import compose_job
from specforge_k25.draft.objective import Teacher
from specforge_k25.draft.eagle3.loss import loss_positions, ttt_loss
from specforge_k25.setup.layout import World
from specforge_k25.train import distributed
from specforge_k25.train.distributed import Ranks

from rank_runs import assert_same_evals, max_rel_diff, rank_env, run_side_by_side
from ttt_reference import _tiny_setup, reference_ttt  # tests/fixtures: the float64 loop reference of the TTT loss

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "fixtures" / "dp_train_worker.py")


# ------------------------------------------------------------------ global-token normalisation
def _float64_teacher(final, lm_head_full, d2t, cfg) -> Teacher:
    full = final @ lm_head_full.T  # [B, T, V] float64
    used = torch.arange(cfg.draft_vocab_size) + d2t
    inv = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
    inv[used] = torch.arange(cfg.draft_vocab_size)
    return Teacher(full[..., used], torch.logsumexp(full, -1), inv[full.argmax(-1)])


def _rows(x, rows: slice, T: int):
    return x[rows, :T]


def test_global_token_normalisation_equals_single_rank_float64():
    """Rank 0 gets sequence 0 (9 tokens), rank 1 sequence 1 (6 tokens, padded only to 6): their loss
    position counts differ. Each rank divides its summed soft-CE by the count summed over both
    ranks; the sum of the two rank losses and of their gradients must equal the one-rank loss of
    the whole batch (float64: 1e-12), and the independent loop reference."""
    K = 3
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = _tiny_setup(seed=1)
    teacher = _float64_teacher(final, lm_head_full, d2t, cfg)
    params = [p for p in draft.parameters() if p.requires_grad]

    whole = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K)
    whole_grads = torch.autograd.grad(whole.loss, params)

    parts = [(slice(0, 1), int(lengths[0])), (slice(1, 2), int(lengths[1]))]  # (rows, padded length)
    local_batches = []
    for rows, T in parts:
        sub_teacher = Teacher(*(_rows(t, rows, T) for t in (teacher.draft_logits, teacher.logsumexp,
                                                           teacher.argmax_draft_id)))
        local_batches.append((_rows(aux, rows, T), _rows(input_ids, rows, T), _rows(loss_mask, rows, T),
                              lengths[rows], sub_teacher))
    counts = [loss_positions(m, n, t, K) for _, _, m, n, t in local_batches]
    assert counts[0].tolist() != counts[1].tolist(), "the test needs uneven counts"
    global_counts = counts[0] + counts[1]  # what the all-reduce computes
    assert global_counts.tolist() == whole.counted.tolist()

    loss_sum, grad_sum, local_means = 0.0, [torch.zeros_like(p) for p in params], []
    for (a, ids, m, n, t), c in zip(local_batches, counts):
        res = ttt_loss(draft, a, ids, m, n, t, ttt_length=K, normalizer=global_counts)
        assert res.counted.tolist() == c.tolist()  # loss_positions == what ttt_loss counts
        grads = torch.autograd.grad(res.loss, params)
        loss_sum = loss_sum + res.loss.detach()
        grad_sum = [g0 + g for g0, g in zip(grad_sum, grads)]
        local_means.append(ttt_loss(draft, a, ids, m, n, t, ttt_length=K).loss.detach())

    assert res.loss.dtype == torch.float64
    torch.testing.assert_close(loss_sum, whole.loss.detach(), rtol=1e-12, atol=0)
    ref_loss = reference_ttt(draft, aux, input_ids, loss_mask, lengths, final, lm_head_full, d2t, K)[0]
    torch.testing.assert_close(loss_sum, ref_loss.detach(), rtol=1e-10, atol=0)
    for g, wg in zip(grad_sum, whole_grads):
        torch.testing.assert_close(g, wg, rtol=0, atol=1e-12 * max(wg.abs().max().item(), 1.0))
    # The alternative this replaces: the mean of per-rank means is a different (wrong) objective.
    assert abs(float(sum(local_means) / 2 - whole.loss.detach())) > 1e-3 * float(whole.loss.detach())


def test_normalizer_none_keeps_the_single_rank_loss_bit_identical():
    K = 3
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = _tiny_setup(seed=2)
    teacher = _float64_teacher(final, lm_head_full, d2t, cfg)
    plain = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K)
    own = ttt_loss(draft, aux, input_ids, loss_mask, lengths, teacher, ttt_length=K,
                   normalizer=loss_positions(loss_mask, lengths, teacher, K))
    assert plain.loss.item() == own.loss.item()


def test_rank_major_slices():
    batch = [10, 11, 12, 13]
    assert [Ranks(rank=r, world=2).share(batch, 2) for r in range(2)] == [[10, 11], [12, 13]]
    assert [Ranks(rank=r, world=2).share([10, 11, 12], 2) for r in range(2)] == [[10, 11], [12]]
    assert [Ranks(rank=r, world=2).share([10], 2) for r in range(2)] == [[10], []]  # short last batch


# ------------------------------------------------------------------ the prepared data, the same on every rank
def _data(*train_and_heldout):
    from specforge_k25.data.dataset import TokenizedData
    from specforge_k25.data.tokenize import Sample

    def sample(ids):
        return Sample(torch.tensor(ids, dtype=torch.int64), torch.tensor([i % 2 == 0 for i in ids]))

    train, heldout = train_and_heldout
    return TokenizedData([sample(x) for x in train], [sample(x) for x in heldout])


def test_data_hash_covers_both_splits_and_keeps_the_fingerprint_hash():
    base = _data([[1, 2, 3], [4, 5]], [[6, 7]])
    assert base.sha1() == _data([[1, 2, 3], [4, 5]], [[6, 7]]).sha1()
    for other in (_data([[1, 2, 3], [4, 5]], [[6, 8]]),  # a held-out token
                  _data([[1, 2], [3, 4, 5]], [[6, 7]]),  # the same tokens cut into other samples
                  _data([[1, 2, 3]], [[4, 5], [6, 7]]),  # a sample moved to the held-out split
                  _data([[4, 5], [1, 2, 3]], [[6, 7]])):  # another order
        assert other.sha1() != base.sha1()
    flipped = _data([[1, 2, 3], [4, 5]], [[6, 7]])
    flipped.train[0].loss_mask[2] = ~flipped.train[0].loss_mask[2]
    assert flipped.sha1() != base.sha1()
    # the resume fingerprint's hash of the training split, as older checkpoints recorded it
    import hashlib

    old = hashlib.sha1()
    for s in base.train:
        old.update(s.input_ids.numpy().tobytes())
        old.update(s.loss_mask.numpy().tobytes())
    assert base.train_sha1() == old.hexdigest()


def test_ranks_refuse_different_prepared_data_by_name(monkeypatch):
    """One all_gather of every rank's hash (here a stand-in); any rank differing from rank 0 is named."""
    import torch.distributed as dist

    calls = []

    def gathering(peers):
        def all_gather_object(out, obj):
            calls.append(obj)
            out[:] = peers
        return all_gather_object

    monkeypatch.setattr(dist, "all_gather_object", gathering(["a", "a", "a"]))
    Ranks(rank=2, world=3).check_same_data("a")
    monkeypatch.setattr(dist, "all_gather_object", gathering(["a", "b", "a", "c"]))
    with pytest.raises(ValueError, match=r"trainer rank\(s\) \[1, 3\] prepared different data than rank 0 "
                                         r"\(sha1 of .*: rank 0 a, rank 1 b, rank 3 c\)"):
        Ranks(rank=0, world=4).check_same_data("a")
    assert calls == ["a", "a"]  # one collective per check
    Ranks().check_same_data("anything")  # one rank: nothing to compare, no collective
    assert len(calls) == 2


def test_run_training_compares_the_prepared_data_before_training(monkeypatch, tmp_path):
    """run_training hands the ranks' check the hash of what `prepare` built, before any Trainer."""
    from types import SimpleNamespace

    import specforge_k25.train.run as trainer_mod
    from specforge_k25.config import JobConfig

    @dataclasses.dataclass(frozen=True)
    class Checked(Ranks):
        seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

        def check_same_data(self, digest: str) -> None:
            self.seen.append(digest)
            raise ValueError("refused")

    data = _data([[1, 2, 3], [4, 5]], [[6, 7]])
    ranks = Checked(rank=1, world=2)
    monkeypatch.setattr(trainer_mod, "prepare", lambda job: SimpleNamespace(data=data))
    monkeypatch.setattr(trainer_mod, "start_ranks", lambda job: (job, ranks))
    monkeypatch.setattr(trainer_mod, "Trainer", lambda *a, **kw: pytest.fail("a Trainer before the data check"))
    job = JobConfig()
    job.hw.trainer_threads = torch.get_num_threads()  # leave this process's threads as they are
    with pytest.raises(ValueError, match="refused"):
        trainer_mod.run_training(job, tmp_path / "run")
    assert ranks.seen == [data.sha1()]


# ------------------------------------------------------------------ this rank's place in the node layout
# (the layout of every profile and the launch checks: tests/setup/test_layout.py)
@pytest.mark.parametrize("layout,ranks_per_node,local_rank,gpus,per_replica", [
    ("colocated", 8, 5, (5, 4), 4),  # beside TP rank 1 of the replica on GPUs 4-7
    ("dedicated", 2, 1, (4, 4), 1),  # hw.trainer_gpus [0, 4]: on the first GPU of the replica on 4-7
])
def test_start_ranks_takes_the_node_layout(monkeypatch, layout, ranks_per_node, local_rank, gpus, per_replica):
    """A rank of b300x8 (process group and device stood in): its trainer GPU and its replica's
    first GPU go into its job, and its Ranks read one replica's share (colocated: sharded)."""
    world = World(rank=local_rank, size=ranks_per_node, local_rank=local_rank, local_size=ranks_per_node)
    calls = []
    monkeypatch.setattr(distributed.torch.cuda, "set_device", lambda gpu: calls.append(("set_device", gpu)))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: world.rank)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: world.size)
    monkeypatch.setattr(distributed, "start_heartbeat", lambda job, rank, world, nccl: calls.append(("heartbeat", nccl)))
    job = compose_job(["+hw=b300x8", f"hw.trainer_layout={layout}"])
    job, ranks = distributed.start_ranks(job, world)
    assert (job.hw.trainer_gpu, job.hw.target_gpu) == gpus
    assert calls == [("set_device", gpus[0]), "nccl", ("heartbeat", True)]  # NCCL: the heartbeat by default
    assert ranks == Ranks(rank=local_rank, world=ranks_per_node, local_rank=local_rank, per_replica=per_replica,
                          colocated=layout == "colocated")
    assert ranks.replica == local_rank // per_replica
    # one rank: no process group, a plain Ranks() whatever the layout
    assert distributed.start_ranks(compose_job(["+hw=b300x8"]), World()) == (compose_job(["+hw=b300x8"]), Ranks())


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


@pytest.mark.slow
def test_cli_under_torchrun_refuses_a_world_that_does_not_match(tmp_path):
    """The real CLI: one rank started for a two-replica profile stops before any engine starts."""
    t0 = time.monotonic()
    out = subprocess.run(_torchrun(1, "-m", "specforge_k25.train", "hw.target_replicas=2", "train.logger=none",
                                   f"train.out_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"),
                         capture_output=True, text=True, timeout=300, env=rank_env(), cwd=ROOT)
    assert out.returncode != 0
    assert "1 trainer rank(s) were started on this node" in out.stderr, out.stderr[-3000:]
    assert "torchrun --nproc-per-node 2" in out.stderr
    assert time.monotonic() - t0 < 120
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ two ranks == one rank x 2b
# 13 training samples, global batch 4 (2 ranks x 2 | 1 rank x 4): every epoch ends with a one-sample
# micro-batch, in which rank 1 has no share; grad_accum 2, 2 epochs -> 4 optimizer steps; 3
# held-out samples -> eval batch [2 | 1] sharded over the ranks.
#
# Tolerance. Adam divides each gradient element by its own running RMS, so where a gradient
# element is mostly cancellation, the fp32 rounding differences between one [4, T] batch and two
# [2, T'] batches (summation order, matmul blocking, padding length) become O(lr) weight
# differences; with lr 1e-3 we measured 2e-5 relative after 6 steps (3 epochs). Here lr=1000 with
# grad_clip=1e-10 puts every clipped gradient element (~1e-13) far below Adam's eps (1e-8): the
# update is lr/eps x the momentum of the clipped gradient, linear in the gradient, and the weights
# still move by O(0.1) per step. What remains is fp32 rounding of the gradients themselves:
# measured 2.7e-7 of each tensor's largest weight (6e-7 after 3 epochs); 2e-6 is allowed.
# Measured with deliberate bugs: no gradient all-reduce -> 0.88, per-rank (local) loss
# normalisation -> 0.42.
COMMON = ["target=tiny_deepseek", "data.num_samples=13", "data.heldout_samples=3", "data.max_length=64",
          "draft.vocab_size=1024", "draft.ttt_length=3", "train.grad_accum=2", "train.epochs=2",
          "train.lr=1000", "train.grad_clip=1e-10", "train.log_every=1", "train.checkpoint_every=1",
          "train.keep_checkpoints=10", "train.progress=false", "train.logger=none"]


def _train_records(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "train/loss" in l]


TWO_RANKS = [*COMMON, "train.batch_size=2", "hw.target_replicas=2"]


@pytest.fixture(scope="module")
def dp_runs(tiny_deepseek_path, tmp_path_factory):
    """One rank x batch 4 (plain python) and two ranks x batch 2 (torchrun), run side by side."""
    root = tmp_path_factory.mktemp("dp")
    one, two = root / "one", root / "two"
    logs = run_side_by_side([[sys.executable, WORKER, str(one), *COMMON, "train.batch_size=4"],
                             _torchrun(2, WORKER, str(two), *TWO_RANKS, "train.heartbeat_timeout_s=30")],
                            timeout=600)  # with the heartbeat (NCCL's default): no effect on a healthy run
    return one, two, logs


@pytest.mark.e2e
def test_two_ranks_equal_one_rank_with_the_doubled_batch(dp_runs):
    one, two, logs = dp_runs
    assert logs[1].count("run plan") == 1 and "ranks       2 data-parallel trainer ranks" in logs[1]  # rank 0 prints

    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s2["trainer_ranks"] == 2 and s1["trainer_ranks"] == 1
    for key in ("steps", "samples_trained", "tokens_trained"):
        assert s1[key] == s2[key], key
    assert s1["steps"] == 4 and s1["samples_trained"] == 26
    assert s2["disk"]["hidden_state_bytes_on_disk"] == 0

    # every checkpoint (steps 1..4) and the export: same weights
    ckpts = sorted(p.name for p in (one / "checkpoints").iterdir())
    assert ckpts == sorted(p.name for p in (two / "checkpoints").iterdir()) and len(ckpts) == 4
    diffs = {c: max_rel_diff(load_file(one / "checkpoints" / c / "draft.safetensors"),
                              load_file(two / "checkpoints" / c / "draft.safetensors")) for c in ckpts}
    a, b = load_file(one / "export" / "model.safetensors"), load_file(two / "export" / "model.safetensors")
    diffs["export"] = max_rel_diff(a, b)
    print("max relative weight difference per checkpoint:", diffs)
    assert max(diffs.values()) < 2e-6, diffs
    # the weights did move: step 1 -> 4 changes them by far more than the tolerance
    first = load_file(one / "checkpoints" / ckpts[0] / "draft.safetensors")
    assert max_rel_diff(first, load_file(one / "checkpoints" / ckpts[-1] / "draft.safetensors")) > 1e-2

    # only rank 0 logged (one record per step); the logged loss is the global one
    r1, r2 = _train_records(one), _train_records(two)
    assert [r["optimizer_step"] for r in r2] == list(range(1, 5))
    # (accuracies: an argmax near-tie may flip under fp32 rounding, hence abs 0.05)
    for x, y in zip(r1, r2):
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-5, abs=1e-6)
        assert y["train/positions"] == x["train/positions"]
        assert y["train/acc_0"] == pytest.approx(x["train/acc_0"], abs=0.05)
    # sharded evaluation summed over the ranks: the same positions and metrics as one rank
    assert_same_evals(s1, s2)


@pytest.mark.e2e
def test_two_ranks_resume_from_rank0_checkpoint_bit_identically(dp_runs, tmp_path):
    """The two-rank run, cut back to its step-2 checkpoint (as after a crash) and resumed with
    train.resume=auto by both ranks, ends with exactly the weights of the uninterrupted run."""
    import shutil

    _, two, _ = dp_runs
    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    out = subprocess.run(_torchrun(2, WORKER, str(run), *TWO_RANKS, "train.resume=auto"), env=rank_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    assert out.stdout.count("resuming from") == 1  # rank 0 prints
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("step_00000002")
    a, b = load_file(two / "export" / "model.safetensors"), load_file(run / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["optimizer_step"] for r in _train_records(run)] == [3, 4]


@pytest.mark.e2e
def test_two_rank_checkpoint_resumes_on_one_rank_with_the_same_global_batch(dp_runs, tmp_path):
    """Resharding: the two-rank run's step-2 checkpoint (2 ranks x batch 2) resumed by ONE rank x
    batch 4. The schedule and its cursor count global batches, so the resumed rank trains exactly
    what the checkpoint had not: steps 3 and 4 see the uninterrupted runs' loss positions and
    tokens, and the weights end where both runs' do (the tolerance of the comparison above).
    Planted: the cursor moved back one micro-batch on a resharded resume (a repeat) fails here
    (27 samples trained, not 26); ~45 s on 2 cores."""
    import shutil

    one, two, _ = dp_runs
    run = tmp_path / "resharded"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    out = subprocess.run([sys.executable, WORKER, str(run), *COMMON, "train.batch_size=4", "train.resume=auto"],
                         env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    assert "saved by 2 dedicated trainer rank(s) x batch 2, resumed on 1 dedicated x batch 4" in out.stdout
    s1, s = (json.loads((d / "summary.json").read_text()) for d in (one, run))
    assert s["resumed_from"].endswith("step_00000002") and s["trainer_ranks"] == 1
    for key in ("steps", "samples_trained", "tokens_trained"):
        assert s[key] == s1[key], key
    resumed, whole = _train_records(run), _train_records(one)[2:]
    assert [r["optimizer_step"] for r in resumed] == [3, 4]
    for x, y in zip(whole, resumed):
        assert y["train/positions"] == x["train/positions"]
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-5, abs=1e-6)
    assert_same_evals(s1, s)
    weights = load_file(run / "export" / "model.safetensors")
    diffs = [max_rel_diff(load_file(d / "export" / "model.safetensors"), weights) for d in (one, two)]
    assert max(diffs) < 2e-6, diffs


# ------------------------------------------------------------------ a hung rank does not hang the others
def _rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from specforge_k25.config import JobConfig
    from specforge_k25.train.distributed import RankFailed, start_ranks, stop_ranks

    job = JobConfig()
    job.hw.target_replicas, job.train.dist_timeout_s = 2, 5.0
    job, ranks = start_ranks(job)
    ranks.check_same_data("same")  # both ranks take part: the data check passes, then is refused by name
    try:
        ranks.check_same_data(f"sha1-of-rank-{rank}")
        results.put(("data", rank, "accepted"))
    except ValueError as err:
        results.put(("data", rank, str(err)))
    if rank == 1:
        time.sleep(60)  # then hangs (never joins the next collective)
        return
    t0 = time.monotonic()
    try:
        ranks.sum(torch.ones(2))
        results.put(("returned", time.monotonic() - t0, ""))
    except RankFailed as err:
        results.put(("RankFailed", time.monotonic() - t0, str(err)))
    stop_ranks()


@pytest.mark.slow
def test_a_hung_rank_makes_the_collective_fail_after_the_timeout():
    """Two gloo ranks: the prepared-data check (one all_gather) accepts equal hashes and refuses
    different ones on both ranks; then rank 1 hangs, and rank 0's next collective fails after
    train.dist_timeout_s."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        data = sorted(results.get(timeout=120) for _ in range(2))
        kind, waited, message = results.get(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    # different prepared data: refused on both ranks, naming the rank that differs (gloo, real all_gather)
    assert [r for _, r, _ in data] == [0, 1]
    for _, _, text in data:
        assert "trainer rank(s) [1] prepared different data than rank 0" in text, text
        assert "rank 0 sha1-of-rank" in text and "rank 1 sha1-of-rank" in text, text
    assert kind == "RankFailed", (kind, waited)
    assert 4 <= waited < 30, waited  # train.dist_timeout_s=5
    assert "another rank died or hung" in message


def test_target_process_does_not_inherit_torchrun_variables(monkeypatch):
    """Inherited TORCHELASTIC_USE_AGENT_STORE=True makes SGLang's own torch.distributed setup in the
    target process wait for a store nobody serves (seen: the engine hung under torchrun)."""
    from specforge_k25.train.distributed import launcher_env_hidden

    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                 "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    probe = ("import os; print(sorted(k for k in os.environ if k.startswith('TORCHELASTIC') "
             "or k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_PORT', 'OMP_NUM_THREADS')))")
    with launcher_env_hidden():
        child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "['OMP_NUM_THREADS']"  # unrelated variables stay
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["RANK"] == "1"  # restored


def _regenerated_rows(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "regenerated.jsonl").read_text().splitlines()]
    return sorted((r["kind"], r["sample"], r["status"], r["answer_tokens"], r["answer"]) for r in rows)


@pytest.mark.engine
@pytest.mark.e2e
def test_regeneration_with_two_replicas_equals_one_replica(tiny_deepseek_path, tmp_path):
    """data.regenerate with two data-parallel replicas: each target answers its own share, and the
    run trains on, counts and writes every rank's answers. Greedy answers of the same TP1 engine,
    so one replica x batch 4 and two replicas x batch 2 train on the same conversations: the same
    tokens, the same rows in regenerated.jsonl (rank 0 writes those of both ranks), the same counts."""
    regen = ["target=tiny_deepseek", "data.regenerate=true", "data.regen_max_new_tokens=8", "data.num_samples=12",
             "data.heldout_samples=2", "data.max_length=64", "draft.vocab_size=1024", "draft.ttt_length=3",
             "train.progress=false", "train.logger=none"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_side_by_side([[sys.executable, "-m", "specforge_k25.train", *regen, "train.batch_size=4",
                       f"train.out_dir={one}", f"hydra.run.dir={one}/hydra"],
                      _torchrun(2, "-m", "specforge_k25.train", *regen, "hw.target_replicas=2", "train.batch_size=2",
                                f"train.out_dir={two}", f"hydra.run.dir={two}/hydra")], timeout=900)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s2["trainer_ranks"] == 2 and s1["samples_trained"] == s2["samples_trained"] == 12
    assert s1["tokens_trained"] == s2["tokens_trained"] > 12 * 8
    assert s1["eval"]["end"]["positions"] == s2["eval"]["end"]["positions"] > 0
    rows = _regenerated_rows(two)
    assert rows == _regenerated_rows(one)
    assert sorted(s for kind, s, *_ in rows if kind == "train") == list(range(12))  # both ranks' samples
    assert s2["regeneration"] == s1["regeneration"]
    assert s2["regeneration"]["answer_tokens_in_loss"] == sum(r[3] for r in rows)
    assert s2["disk"]["hidden_state_bytes_on_disk"] == 0
    # the answers' token ids: rank 0 saves both ranks' (each prompt once), as one replica saves them
    ids = [(d / "regenerated_ids.jsonl").read_text().splitlines() for d in (one, two)]
    assert ids[0][0] == ids[1][0] and sorted(ids[0][1:]) == sorted(ids[1][1:])
    keys = [json.loads(x)["prompt_sha1"] for x in ids[1][1:]]
    assert len(keys) == len(set(keys)) >= 12  # two samples may share a prompt (one answer for both)
    # a later run on those saved answers (data.regen_source through the target process) decodes
    # nothing and trains bit for bit as the run that decoded them
    three = tmp_path / "three"
    log, = run_side_by_side([[sys.executable, "-m", "specforge_k25.train", *regen, "train.batch_size=4",
                              f"data.regen_source={one}", f"train.out_dir={three}", f"hydra.run.dir={three}/hydra"]],
                            timeout=900)
    assert "regeneration: 14 of 14 samples to run have a saved answer (not decoded again)\n" in log, log[-3000:]
    s3 = json.loads((three / "summary.json").read_text())
    assert s3["eval"] == s1["eval"] and s3["tokens_trained"] == s1["tokens_trained"]
    assert s3["regeneration"] == s1["regeneration"]
    assert (three / "export" / "model.safetensors").read_bytes() == (one / "export" / "model.safetensors").read_bytes()
