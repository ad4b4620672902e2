"""Tests of training checkpoints (specforge_k25/train/checkpoint.py): exact resume of draft,
AdamW state, LR schedule and RNG; pruning; crash safety; no pickle; shape mismatch.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import specforge_k25.train.checkpoint as ckpt_mod
from specforge_k25.draft.method import draft_state
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from specforge_k25.train.optim import build_optimizer, build_scheduler

V, VD, H = 300, 50, 32
TOTAL_STEPS = 10


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def make_cfg(**over) -> DraftConfig:
    kw = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              vocab_size=V, draft_vocab_size=VD, target_hidden_size=H)
    kw.update(over)
    return DraftConfig(**kw)


def make_draft(seed: int, **over) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(make_cfg(**over))
    with torch.no_grad():
        d2t, t2d = build_vocab_maps(torch.randint(0, 1000, (draft.cfg.vocab_size,)), draft.cfg.draft_vocab_size)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


def make_training(seed: int, **over):
    draft = make_draft(seed, **over)
    opt = build_optimizer(draft.trainable_parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = build_scheduler(opt, TOTAL_STEPS, warmup_ratio=0.2)
    return draft, opt, sched


def batch(seed: int, B: int = 2, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3 * H, generator=g), torch.randint(0, V, (2, B, T), generator=g)


def fake_loss(draft: Eagle3Draft, aux, ids) -> torch.Tensor:
    """Two TTT steps so every trainable tensor (fc, attention, MLP, norms, lm_head) gets a gradient."""
    B, T = ids.shape[1:]
    cache: list = []
    h = draft.project(aux)
    loss = 0.0
    for k in range(ids.shape[0]):
        h, kv = draft.step(ids[k], h, torch.arange(T).expand(B, T) + k, cache)
        cache.append(kv)
        loss = loss + torch.log_softmax(draft.logits(h), -1)[..., 0].sum()
    return -loss


def train_step(draft, opt, sched, seed: int) -> None:
    aux, ids = batch(seed)
    fake_loss(draft, aux, ids).backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def trainable_tensors(draft) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in draft_state(draft).items()}


# -------------------------------------------------------------------------------- 5. resume
def test_save_load_restores_everything_and_resumes_bit_exact(tmp_path):
    draft, opt, sched = make_training(seed=0)
    for s in range(2):
        train_step(draft, opt, sched, seed=100 + s)
    assert len(opt.state_dict()["state"]) == len(draft.trainable_parameters())  # every param has AdamW state
    torch.manual_seed(1234)
    rng_at_save = torch.get_rng_state()
    path = save_checkpoint(tmp_path, 2, draft.state_dict(), opt.state_dict(), sched.state_dict(), {"micro_batches": 4, "plan_item": 7}, keep=2)
    assert path == tmp_path / "checkpoints" / "step_00000002"
    assert list_checkpoints(tmp_path) == [path]

    # fresh objects, different weights; only the (frozen, not saved) target embedding is injected
    draft2, opt2, sched2 = make_training(seed=99)
    with torch.no_grad():
        draft2.embed_tokens.weight.copy_(draft.embed_tokens.weight)
    assert not torch.equal(draft2.fc.weight, draft.fc.weight)
    torch.rand(1000)  # move the RNG away from the saved state
    assert not torch.equal(torch.get_rng_state(), rng_at_save)

    state = load_checkpoint(path, draft2, opt2, sched2)
    assert state["step"] == 2 and state["micro_batches"] == 4 and state["plan_item"] == 7
    assert torch.equal(torch.get_rng_state(), rng_at_save)

    want, got = trainable_tensors(draft), draft_state(draft2)
    assert set(want) == set(got) and "embed_tokens.weight" not in want
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k

    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert set(sd1["state"]) == set(sd2["state"])
    for pid, st in sd1["state"].items():
        assert set(st) == set(sd2["state"][pid]) == {"step", "exp_avg", "exp_avg_sq"}
        for name, value in st.items():
            other = sd2["state"][pid][name]
            assert torch.is_tensor(other) and other.dtype == value.dtype and torch.equal(other, value), (pid, name)
    for g1, g2 in zip(sd1["param_groups"], sd2["param_groups"]):
        assert g1["lr"] == g2["lr"] and g1["initial_lr"] == g2["initial_lr"]
        assert tuple(g1["betas"]) == tuple(g2["betas"]) and g1["weight_decay"] == g2["weight_decay"]
        assert g1["params"] == g2["params"]
    s1, s2 = sched.state_dict(), sched2.state_dict()
    assert s1["last_epoch"] == s2["last_epoch"] == 2
    assert s1["_step_count"] == s2["_step_count"]
    assert s1["_last_lr"] == s2["_last_lr"] and s1["base_lrs"] == s2["base_lrs"]
    assert sched.get_last_lr() == sched2.get_last_lr()

    # one more identical step on both: bit-identical weights, optimizer state and LR
    train_step(draft, opt, sched, seed=200)
    train_step(draft2, opt2, sched2, seed=200)
    after1, after2 = draft_state(draft), draft_state(draft2)
    for k in after1:
        assert torch.equal(after1[k], after2[k]), k
    assert not torch.equal(after1["fc.weight"], want["fc.weight"])  # the step did change the weights
    for pid, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            assert torch.equal(opt2.state_dict()["state"][pid][name], value), (pid, name)
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_load_without_optimizer_restores_draft_only(tmp_path):
    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    path = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=2)
    fresh = make_draft(seed=5)
    load_checkpoint(path, fresh)
    for k, v in draft_state(draft).items():
        assert torch.equal(draft_state(fresh)[k], v), k


# ------------------------------------------------------------------------------- 6. pruning
def _names(paths) -> list[str]:
    return [p.name for p in paths]


def test_keep_prunes_to_newest(tmp_path):
    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, step, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=3)
    assert _names(list_checkpoints(tmp_path)) == ["step_00000003", "step_00000004", "step_00000005"]
    on_disk = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert on_disk == ["step_00000003", "step_00000004", "step_00000005"]  # pruned ones are really gone
    save_checkpoint(tmp_path, 6, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=1)
    assert _names(list_checkpoints(tmp_path)) == ["step_00000006"]
    # numeric order, not insertion order: step 12 sorts after step 6 (zero padded)
    save_checkpoint(tmp_path, 12, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=2)
    assert _names(list_checkpoints(tmp_path)) == ["step_00000006", "step_00000012"]


def test_keep_zero_keeps_all(tmp_path):
    draft, opt, sched = make_training(seed=0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=0)
    assert _names(list_checkpoints(tmp_path)) == ["step_00000001", "step_00000002", "step_00000003"]


def test_list_ignores_incomplete_and_temporary(tmp_path):
    assert list_checkpoints(tmp_path) == []  # no checkpoints folder yet
    draft, opt, sched = make_training(seed=0)
    save_checkpoint(tmp_path, 3, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=5)
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step_00000009-12345"  # an interrupted save, even one that wrote state.json
    tmp.mkdir()
    (tmp / "state.json").write_text("{}")
    (root / "step_00000010").mkdir()  # no state.json
    (root / "step_00000010" / "draft.safetensors").write_bytes(b"partial")
    (root / "step_00000011").write_text("a file, not a folder")
    (root / "notes").mkdir()
    (root / "notes" / "state.json").write_text("{}")
    assert _names(list_checkpoints(tmp_path)) == ["step_00000003"]


# ----------------------------------------------------------------------------- 7. atomicity
def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _crash_on_second_save_file(monkeypatch):
    real = ckpt_mod.save_file
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_file", flaky)
    return calls


def _crash_on_replace(monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("killed during rename (simulated)")

    monkeypatch.setattr(ckpt_mod.os, "replace", boom)


@pytest.mark.parametrize("crash", [_crash_on_second_save_file, _crash_on_replace], ids=["save_file", "os_replace"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash):
    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    good = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {"tag": "good"}, keep=1)
    saved_weights = trainable_tensors(draft)
    before = _snapshot(good)

    train_step(draft, opt, sched, seed=2)
    with monkeypatch.context() as m:
        crash(m)
        with pytest.raises(OSError, match="simulated"):
            save_checkpoint(tmp_path, 2, draft.state_dict(), opt.state_dict(), sched.state_dict(), {"tag": "crashed"}, keep=1)

    assert list_checkpoints(tmp_path) == [good]
    assert _snapshot(good) == before
    fresh, fopt, fsched = make_training(seed=7)
    state = load_checkpoint(good, fresh, fopt, fsched)
    assert state["step"] == 1 and state["tag"] == "good"
    for k, v in saved_weights.items():
        assert torch.equal(draft_state(fresh)[k], v), k

    # the next save works despite the leftover temporary folder, and pruning keeps the newest
    again = save_checkpoint(tmp_path, 2, draft.state_dict(), opt.state_dict(), sched.state_dict(), {"tag": "retry"}, keep=1)
    assert list_checkpoints(tmp_path) == [again]
    assert load_checkpoint(again, make_draft(seed=8))["tag"] == "retry"


def test_checkpoint_files_hold_no_pickle(tmp_path):
    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    path = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {"note": "x"}, keep=1)
    assert sorted(p.name for p in path.iterdir()) == ["draft.safetensors", "manifest.json", "optimizer.safetensors",
                                                      "state.json"]
    d = load_file(path / "draft.safetensors")
    assert "embed_tokens.weight" not in d and set(d) == set(draft_state(draft))
    o = load_file(path / "optimizer.safetensors")
    assert "rng.torch" in o and any(k.endswith(".exp_avg") for k in o)
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 1 and state["note"] == "x" and "scheduler" in state and "optimizer" in state
    for name in ("draft.safetensors", "optimizer.safetensors"):
        raw = (path / name).read_bytes()  # safetensors layout: u64 header length, JSON header, raw bytes
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        assert all(v["dtype"] in ("F32", "I64", "BOOL", "U8") for k, v in header.items() if k != "__metadata__"), name


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_checkpoint_files_get_the_umask_mode(tmp_path, mask, mode):
    """Every file of a checkpoint gets the mode the umask gives any new file (safetensors' own
    temporary file would leave the tensors 0600 beside a 0644 state.json)."""
    import os

    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    saved = os.umask(mask)
    try:
        path = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=1)
    finally:
        os.umask(saved)
    assert {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()} == {
        "draft.safetensors": mode, "optimizer.safetensors": mode, "state.json": mode, "manifest.json": mode}
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_00000001"]  # no temporary file left


# ---------------------------------------------------------------------------- 8. mismatch
@pytest.mark.parametrize("over", [{"intermediate_size": 64}, {"draft_vocab_size": 40}, {"target_hidden_size": 48}],
                         ids=["I", "Vd", "Ht"])
def test_load_into_different_shape_raises(tmp_path, over):
    draft, opt, sched = make_training(seed=0)
    path = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=1)
    other = make_draft(seed=1, **over)
    with pytest.raises((ValueError, RuntimeError), match="size mismatch|does not match"):
        load_checkpoint(path, other)


def test_load_checkpoint_missing_tensor_raises(tmp_path):
    draft, opt, sched = make_training(seed=0)
    path = save_checkpoint(tmp_path, 1, draft.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=1)
    tensors = load_file(path / "draft.safetensors")
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, path / "draft.safetensors")
    with pytest.raises(ValueError, match=r"does not match the draft.*midlayer\.mlp\.up_proj\.weight"):
        load_checkpoint(path, make_draft(seed=1))


# ------------------------------------------------------------------ 9. what a resume must match
def _fingerprint(ranks: int = 1, batch_size: int = 4, layout: str = "dedicated", regenerate: bool = False,
                 regen_cut: str = "keep", method: str = "eagle3", context_parallel: int = 1) -> dict:
    """run_fingerprint of a small stand-in setup: ranks x batch_size trainer ranks."""
    import dataclasses
    from types import SimpleNamespace

    from specforge_k25.config import JobConfig
    from specforge_k25.data.dataset import TokenizedData
    from specforge_k25.data.tokenize import Sample
    from specforge_k25.draft.registry import get_method
    from specforge_k25.target_engine.sampling import Regeneration
    from specforge_k25.train.fingerprint import run_fingerprint

    job = JobConfig()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, batch_size=batch_size),
                              hw=dataclasses.replace(job.hw, trainer_layout=layout, context_parallel=context_parallel),
                              data=dataclasses.replace(job.data, regen_cut=regen_cut))
    sample = Sample(torch.arange(6), torch.ones(6, dtype=torch.bool))
    setup = SimpleNamespace(model_path=str(Path(__file__).parent),  # no model files: one fixed digest
                            info=SimpleNamespace(architecture="LlamaForCausalLM", num_layers=4, hidden_size=H,
                                                 vocab_size=V),
                            capture_points=[1, 2, 3], draft_cfg=make_cfg(), data=TokenizedData([sample], [sample]),
                            method=get_method(method),
                            regeneration=Regeneration(stop_ids=(0,)) if regenerate else None)
    return run_fingerprint(job, setup, n_items=9, ranks=ranks)


def _older(fingerprint: dict) -> dict:
    """As checkpoints recorded it before: trainer ranks and layout only with several ranks (the
    layout only when co-located), no regen_cut, no draft method."""
    old = {k: v for k, v in fingerprint.items()
           if k not in ("trainer_ranks", "trainer_layout", "regen_cut", "draft_method", "context_parallel")}
    if fingerprint["trainer_ranks"] > 1:
        old["trainer_ranks"] = fingerprint["trainer_ranks"]
        if fingerprint["trainer_layout"] == "colocated":
            old["trainer_layout"] = "colocated"
    return old


def _refusal(saved: dict, current: dict) -> str:
    from specforge_k25.train.fingerprint import check_fingerprint

    with pytest.raises(ValueError, match="belongs to a different run") as err:
        check_fingerprint(saved, current, Path("ckpt"))
    return str(err.value)


def test_resume_onto_other_ranks_needs_the_same_global_batch():
    """The schedule and its cursor count global batches (batch_size x ranks): a checkpoint resumes
    on any number of ranks and either layout that keeps the global batch, old checkpoints included
    (no trainer_ranks recorded: one rank), and is refused by name otherwise."""
    from specforge_k25.train.fingerprint import check_fingerprint

    two_colocated = _fingerprint(ranks=2, batch_size=2, layout="colocated")
    for saved in (two_colocated, _older(two_colocated), _fingerprint(ranks=4, batch_size=1),
                  _fingerprint(1, 4), _older(_fingerprint(1, 4))):
        for now in (_fingerprint(1, 4), _fingerprint(2, 2), _fingerprint(2, 2, "colocated"), _fingerprint(4, 1)):
            check_fingerprint(saved, now, Path("ckpt"))
    # what a one-rank resume of a two-rank checkpoint with the same per-rank batch used to accept
    message = _refusal(_older(_fingerprint(ranks=2, batch_size=1)), _fingerprint(ranks=1, batch_size=1))
    assert "global batch (train.batch_size x trainer ranks / hw.context_parallel): checkpoint 1 x 2 / 1 vs now 1 x 1 / 1" in message
    assert "resume on 1 rank(s) with train.batch_size=2" in message
    # an old checkpoint without trainer_ranks is one rank, not whatever resumes it
    message = _refusal(_older(_fingerprint(ranks=1, batch_size=2)), _fingerprint(ranks=2, batch_size=2))
    assert "checkpoint 2 x 1 / 1 vs now 2 x 2 / 1" in message and "train.batch_size=1" in message
    assert "a number of ranks that divides 3" in _refusal(_fingerprint(1, 3), _fingerprint(2, 1))
    # hw.context_parallel: 4 ranks in groups of 2 x batch 1 = 2 sequences per global batch
    split = _fingerprint(ranks=4, batch_size=1, layout="colocated", context_parallel=2)
    for now in (_fingerprint(1, 2), _fingerprint(2, 1, "colocated"), split):
        check_fingerprint(split, now, Path("ckpt"))
        check_fingerprint(now, split, Path("ckpt"))
    assert "vs now 1 x 4 / 1" in _refusal(split, _fingerprint(ranks=4, batch_size=1, layout="colocated"))


def test_fingerprint_differences_count_on_either_side_and_include_regen_cut():
    now = _fingerprint(regenerate=True, regen_cut="drop")
    assert "regen_cut: checkpoint 'keep' vs now 'drop'" in _refusal(_fingerprint(regenerate=True), now)
    # an older checkpoint recorded no regen_cut: it regenerated with the default, keep
    from specforge_k25.train.fingerprint import check_fingerprint

    check_fingerprint(_older(_fingerprint(regenerate=True)), _fingerprint(regenerate=True), Path("ckpt"))
    assert "regen_cut: checkpoint 'keep' vs now 'drop'" in _refusal(_older(_fingerprint(regenerate=True)), now)
    check_fingerprint(_older(_fingerprint()), _fingerprint(regen_cut="drop"), Path("ckpt"))  # not regenerating
    # a key only one side records is a difference, whichever side
    base = _fingerprint()
    assert "extra: checkpoint 1 vs now '(not recorded)'" in _refusal({**base, "extra": 1}, base)
    assert "extra: checkpoint '(not recorded)' vs now 1" in _refusal(base, {**base, "extra": 1})
    no_seed = {k: v for k, v in base.items() if k != "seed"}
    assert "seed: checkpoint '(not recorded)' vs now 0" in _refusal(no_seed, base)
    assert "global batch" in _refusal({k: v for k, v in base.items() if k != "batch_size"}, base)
    # the draft method: an older checkpoint (none recorded) was the first method's, and another is refused
    check_fingerprint(_older(base), base, Path("ckpt"))
    assert "draft_method: checkpoint 'eagle3' vs now 'eagle3_mla'" in _refusal(_older(base), _fingerprint(method="eagle3_mla"))
    message = _refusal({}, base)  # a checkpoint without a fingerprint matches nothing
    assert "train_data_sha1: checkpoint '(not recorded)'" in message and "draft: checkpoint" in message


# ------------------------------------------------------------------ 10. optimizer state across layouts
def _named_optimizer_state(draft, opt) -> dict:
    """The form a sharded (FSDP2) run gathers and saves: torch's full optimizer state dict, keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(draft, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys(), pid
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][name])), (pid, name)
    assert a["param_groups"] == b["param_groups"]


def test_optimizer_state_converts_between_the_sharded_and_the_plain_form(tmp_path):
    """A co-located run's checkpoint (AdamW keyed by parameter name) resumed by one unsharded rank
    (keyed by index), and the reverse: each converted form is exactly the other run's own, and the
    resumed optimizer steps bit-identically."""
    from specforge_k25.train.checkpoint import optimizer_state_for, read_checkpoint

    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    named, indexed = _named_optimizer_state(draft, opt), opt.state_dict()
    assert set(named["state"]) == set(names)
    _assert_same_optimizer_state(optimizer_state_for(named, opt, names, by_name=False), indexed)
    _assert_same_optimizer_state(optimizer_state_for(indexed, opt, names, by_name=True), named)
    for same, by_name in ((named, True), (indexed, False)):  # a run resuming its own form: unchanged
        _assert_same_optimizer_state(optimizer_state_for(same, opt, names, by_name=by_name), same)

    path = save_checkpoint(tmp_path, 1, draft.state_dict(), named, sched.state_dict(), {}, keep=1)
    _, tensors, optim = read_checkpoint(path)
    fresh, fopt, fsched = make_training(seed=5)
    fresh.load_state_dict({**tensors, "embed_tokens.weight": draft.embed_tokens.weight}, strict=False)
    fopt.load_state_dict(optimizer_state_for(optim, fopt, names, by_name=False))
    fsched.load_state_dict(sched.state_dict())
    train_step(draft, opt, sched, seed=2)
    train_step(fresh, fopt, fsched, seed=2)
    for k, v in draft_state(draft).items():
        assert torch.equal(draft_state(fresh)[k], v), k


def test_optimizer_state_keeps_the_resuming_optimizers_implementation():
    """How AdamW runs (fused, foreach) is the resuming run's: a layout or optimizer_device change
    may change it, torch's load_state_dict would take the saved one."""
    from specforge_k25.train.checkpoint import optimizer_state_for

    draft, opt, sched = make_training(seed=0)
    train_step(draft, opt, sched, seed=1)
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    saved = opt.state_dict()
    saved["param_groups"][0].update(fused=True, foreach=False)
    loaded = optimizer_state_for(saved, opt, names, by_name=False)["param_groups"][0]
    assert (loaded["fused"], loaded["foreach"]) == (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"])
    assert loaded["lr"] == saved["param_groups"][0]["lr"] and loaded["params"] == saved["param_groups"][0]["params"]
    with pytest.raises(ValueError, match="'nope.weight', not a trainable parameter"):
        optimizer_state_for({"state": {"nope.weight": {}}, "param_groups": saved["param_groups"]}, opt, names, False)
