"""What a resume compares (train/fingerprint.py): the target it trains against (config, weights,
dtype), both data splits, the optimizer settings, and the draft's fields that change results; and
what it lets change: the draft's memory-only fields. Each is checked both ways: a change that
alters results is refused by name, one that does not is accepted."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from specforge_k25.config import JobConfig
from specforge_k25.data.dataset import TokenizedData
from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.dflash.model import DFlashConfig
from specforge_k25.draft.eagle3.model import DraftConfig
from specforge_k25.draft.registry import get_method
from specforge_k25.target_engine import folder_digest
from specforge_k25.target_engine.folder_digest import SAMPLE, target_digest
from specforge_k25.train.fingerprint import (OPTIMIZER, check_fingerprint, run_fingerprint, unrecorded,
                                             with_recorded_optimizer)

H, V = 32, 300
EAGLE = DraftConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    vocab_size=V, draft_vocab_size=50, target_hidden_size=H)
DFLASH = DFlashConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=V, target_hidden_size=H, num_aux_hidden_states=3)


def _target(folder: Path, seed: int = 0, config: dict | None = None) -> Path:
    """A small HF-style model folder: config.json and two weight shards with an index."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"], "hidden_size": H}))
    g = torch.Generator().manual_seed(seed)
    save_file({"embed.weight": torch.randn(V, H, generator=g)}, folder / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": torch.randn(V, H, generator=g)}, folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "embed.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return folder


def _sample(ids: list[int]) -> Sample:
    return Sample(torch.tensor(ids), torch.ones(len(ids), dtype=torch.bool))


def _fingerprint(model_path: Path, job: JobConfig | None = None, method: str = "eagle3", draft_cfg=None,
                 heldout: list[int] = (5, 6, 7)) -> dict:
    setup = SimpleNamespace(
        model_path=str(model_path),
        info=SimpleNamespace(architecture="LlamaForCausalLM", num_layers=4, hidden_size=H, vocab_size=V),
        capture_points=[1, 2, 3], method=get_method(method),
        draft_cfg=draft_cfg or (DFLASH if method == "dflash" else EAGLE),
        data=TokenizedData([_sample([1, 2, 3, 4])], [_sample(list(heldout))]), regeneration=None)
    return run_fingerprint(job or JobConfig(), setup, n_items=9)


def _refusal(saved: dict, now: dict) -> str:
    with pytest.raises(ValueError, match="belongs to a different run") as err:
        check_fingerprint(saved, now, Path("ckpt"))
    return str(err.value)


def _train(**changes) -> JobConfig:
    """The default job with `changes` to train.* or, for a draft method's own knob, draft.*."""
    job = JobConfig()
    own = {k: v for k, v in changes.items() if hasattr(job.draft, k)}
    return dataclasses.replace(job, draft=dataclasses.replace(job.draft, **own), train=dataclasses.replace(
        job.train, **{k: v for k, v in changes.items() if k not in own}))


# ---------------------------------------------------------------------------- the target
def test_another_target_of_the_same_shapes_is_refused(tmp_path):
    """A fine-tune (same config, other weights) is another target; a copy of the same folder is not."""
    base = _fingerprint(_target(tmp_path / "base"))
    check_fingerprint(base, _fingerprint(shutil.copytree(tmp_path / "base", tmp_path / "copy")), Path("ckpt"))
    tuned = _fingerprint(_target(tmp_path / "tuned", seed=1))
    assert {k for k in base if base[k] != tuned[k]} == {"target_digest"}  # the shapes all agree
    assert "target_digest: checkpoint" in _refusal(base, tuned)
    revised = _fingerprint(_target(tmp_path / "revised", config={"architectures": ["LlamaForCausalLM"],
                                                                 "hidden_size": H, "rope_theta": 5e5}))
    assert "target_digest: checkpoint" in _refusal(base, revised)


def test_target_dtype_refused_by_name(tmp_path):
    folder = _target(tmp_path / "t")
    job = JobConfig()
    bf16 = dataclasses.replace(job, hw=dataclasses.replace(job.hw, target_dtype="bfloat16"))
    assert "target_dtype: checkpoint 'float32' vs now 'bfloat16'" in _refusal(_fingerprint(folder), _fingerprint(folder, bf16))


def test_the_digest_ignores_files_that_do_not_define_the_model(tmp_path):
    folder = _target(tmp_path / "t")
    before = target_digest(folder)
    (folder / "README.md").write_text("notes")
    (folder / "generation_config.json").write_text("{}")
    assert target_digest(folder) == before
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert target_digest(folder) != before


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_the_digest_samples_a_large_weight_file_without_reading_it_whole(tmp_path, monkeypatch, where):
    """A 64 MiB shard: a byte changed in any of its windows changes the digest, and the digest
    reads three windows of it, not the file."""
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    shard = folder / "model.safetensors"
    size = 64 << 20
    with open(shard, "wb") as fh:
        fh.truncate(size)  # sparse: no time to write
    before = target_digest(folder)
    read = []  # bytes each read of the shard returned
    real_open = open

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def seek(self, offset):
            return self.fh.seek(offset)

        def read(self, n=-1):
            data = self.fh.read(n)
            read.append(len(data))
            return data

    def counting_open(path, *args, **kwargs):
        fh = real_open(path, *args, **kwargs)
        return Counting(fh) if Path(path) == shard else fh

    offset = {"start": 10, "middle": size // 2, "end": size - 10}[where]
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\x01")
    monkeypatch.setattr(folder_digest, "open", counting_open, raising=False)
    assert target_digest(folder) != before
    assert sum(read) == 3 * SAMPLE and SAMPLE <= 1 << 20


# -------------------------------------------------------------------------- the data splits
def test_an_edited_held_out_row_is_refused_and_an_older_checkpoint_is_not_compared(tmp_path):
    folder = _target(tmp_path / "t")
    base = _fingerprint(folder)
    edited = _fingerprint(folder, heldout=(5, 6, 8))
    assert {k for k in base if base[k] != edited[k]} == {"heldout_data_sha1"}
    assert "heldout_data_sha1: checkpoint" in _refusal(base, edited)
    older = {k: v for k, v in base.items() if k != "heldout_data_sha1"}
    check_fingerprint(older, edited, Path("ckpt"))
    assert "heldout_data_sha1" in unrecorded(older)


# -------------------------------------------------------------------------- the optimizer
@pytest.mark.parametrize("name,value,override", [
    ("lr", 0.5, "train.lr=5e-05"), ("betas", [0.8, 0.9], "train.betas=[0.9,0.95]"),
    ("weight_decay", 0.1, "train.weight_decay=0.0"), ("warmup_ratio", 0.5, "train.warmup_ratio=0.015"),
    ("grad_clip", 2.0, "train.grad_clip=0.5"), ("loss_decay", 0.5, "draft.loss_decay=0.8")])
def test_a_changed_optimizer_setting_is_refused_by_name_with_the_override_that_resumes(tmp_path, name, value, override):
    folder = _target(tmp_path / "t")
    base = _fingerprint(folder)
    changed = _fingerprint(folder, _train(**{name: value}))
    assert {k for k in base if base[k] != changed[k]} == {name}
    message = _refusal(base, changed)
    assert f"{name}: checkpoint" in message and f"resume with {override}, or start a new run" in message
    default = getattr(JobConfig().draft if name == "loss_decay" else JobConfig().train, name)
    check_fingerprint(base, _fingerprint(folder, _train(**{name: default})), Path("ckpt"))


def test_every_optimizer_setting_is_recorded(tmp_path):
    fp = _fingerprint(_target(tmp_path / "t"), _train(lr=1e-3))
    assert {k: fp[k] for k in OPTIMIZER} == {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0,
                                             "warmup_ratio": 0.015, "grad_clip": 0.5, "loss_decay": 0.8}


def test_an_older_checkpoint_is_compared_on_what_its_optimizer_state_holds(tmp_path):
    """A checkpoint from before the settings were recorded: its AdamW param group still holds the
    peak lr (as the LR schedule saw it), betas and weight decay; those are compared, the rest
    (warmup, clipping, the loss's step weights) reported as not recorded."""
    from specforge_k25.train.checkpoint import read_state, save_checkpoint
    from specforge_k25.train.optim import build_optimizer, build_scheduler

    folder = _target(tmp_path / "t")
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer([param], 1e-3, [0.9, 0.95], 0.0)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_ratio=0.5)  # lr now 2e-4 of the 1e-3 peak
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    older = {k: v for k, v in _fingerprint(folder, _train(lr=1e-3)).items() if k not in OPTIMIZER}
    path = save_checkpoint(tmp_path / "run", 1, {"w": param.detach()}, optimizer.state_dict(),
                           scheduler.state_dict(), {"fingerprint": older})
    saved = with_recorded_optimizer(read_state(path)["fingerprint"], read_state(path))
    assert {k: saved[k] for k in ("lr", "betas", "weight_decay")} == {"lr": 1e-3, "betas": [0.9, 0.95],
                                                                      "weight_decay": 0.0}
    assert unrecorded(saved) == ["warmup_ratio", "grad_clip", "loss_decay"]
    assert "resume with train.lr=0.001" in _refusal(saved, _fingerprint(folder, _train(lr=0.5)))
    check_fingerprint(saved, _fingerprint(folder, _train(lr=1e-3, warmup_ratio=0.2)), Path("ckpt"))


def test_the_lr_schedule_is_recorded_and_an_older_checkpoint_meant_cosine(tmp_path):
    folder = _target(tmp_path / "t")
    cosine, wsd = _fingerprint(folder), _fingerprint(folder, _train(lr_schedule="wsd"))
    assert (cosine["lr_schedule"], cosine["decay_ratio"]) == ("cosine", None)  # cosine has no decay phase
    assert (wsd["lr_schedule"], wsd["decay_ratio"]) == ("wsd", 0.2)
    assert "lr_schedule: checkpoint 'cosine' vs now 'wsd'" in _refusal(cosine, wsd)
    assert "decay_ratio: checkpoint 0.2 vs now 0.5" in _refusal(wsd, _fingerprint(folder, _train(lr_schedule="wsd",
                                                                                                decay_ratio=0.5)))
    check_fingerprint(cosine, _fingerprint(folder, _train(decay_ratio=0.5)), Path("ckpt"))  # unused by cosine
    older = {k: v for k, v in cosine.items() if k not in ("lr_schedule", "decay_ratio")}
    check_fingerprint(older, cosine, Path("ckpt"))
    assert "lr_schedule: checkpoint 'cosine' vs now 'wsd'" in _refusal(older, wsd)


# ------------------------------------------------------------------------ the draft's fields
def _other(value):
    return (not value) if isinstance(value, bool) else value * 2 + 1 if isinstance(value, int) else value * 0.5


@pytest.mark.parametrize("method,cfg", [("dflash", DFLASH), ("eagle3", EAGLE)])
def test_each_draft_field_refuses_unless_it_only_bounds_memory(tmp_path, method, cfg):
    """DFlash's logits chunk and attention tile (the way out of an out-of-memory error) may change
    on resume; every other field of each method's draft config changes results and is refused."""
    folder = _target(tmp_path / "t")
    base = _fingerprint(folder, method=method, draft_cfg=cfg)
    memory_only = set()
    for f in dataclasses.fields(cfg):
        changed = _fingerprint(folder, method=method,
                               draft_cfg=dataclasses.replace(cfg, **{f.name: _other(getattr(cfg, f.name))}))
        try:
            check_fingerprint(base, changed, Path("ckpt"))
            memory_only.add(f.name)
        except ValueError as err:
            assert f"'{f.name}'" in str(err) and "draft: checkpoint" in str(err), f.name
    assert memory_only == ({"logits_chunk", "attention_tile_rows", "attention_tile_keys"} if method == "dflash"
                           else set())


def test_an_older_dflash_checkpoint_that_recorded_the_tile_resumes_with_another(tmp_path):
    folder = _target(tmp_path / "t")
    now = _fingerprint(folder, method="dflash", draft_cfg=dataclasses.replace(DFLASH, logits_chunk=256,
                                                                              attention_tile_rows=64))
    older = {**now, "draft": dataclasses.asdict(DFLASH)}  # as checkpoints recorded the whole config
    check_fingerprint(older, now, Path("ckpt"))
    assert "'block_size'" in _refusal({**older, "draft": {**older["draft"], "block_size": 4}}, now)


def test_the_eagle3_objective_is_recorded_and_an_older_dflash_checkpoint_still_resumes(tmp_path):
    """The TTT unroll and its weights are EAGLE-3's own knobs (draft.ttt_length, draft.loss_decay):
    an EAGLE-3 run records them, a DFlash run does not, and a DFlash checkpoint written when every
    run recorded train.ttt_length / train.loss_decay resumes."""
    folder = _target(tmp_path / "t")
    eagle = _fingerprint(folder)
    assert (eagle["ttt_length"], eagle["loss_decay"]) == (JobConfig().draft.ttt_length, JobConfig().draft.loss_decay)
    job = JobConfig()
    longer = dataclasses.replace(job, draft=dataclasses.replace(job.draft, ttt_length=3))
    assert "ttt_length: checkpoint 7 vs now 3" in _refusal(eagle, _fingerprint(folder, longer))
    now = _fingerprint(folder, method="dflash")
    assert "ttt_length" not in now and "loss_decay" not in now
    check_fingerprint({**now, "ttt_length": 7, "loss_decay": 0.8}, now, Path("ckpt"))


def test_a_dflash_checkpoint_of_this_code_has_nothing_unrecorded_and_an_older_one_only_what_dflash_records(tmp_path):
    """`loss_decay` is EAGLE-3's: the resume note lists only keys the resuming run records itself
    (every DFlash resume used to say its checkpoint predated recording loss_decay)."""
    folder = _target(tmp_path / "t")
    now = _fingerprint(folder, method="dflash")
    assert unrecorded(now, now) == []
    older = {k: v for k, v in now.items() if k not in ("heldout_data_sha1", "grad_clip")}
    assert unrecorded(older, now) == ["heldout_data_sha1", "grad_clip"]
    assert "loss_decay" in unrecorded(older, _fingerprint(folder))  # an EAGLE-3 run records it
