"""A fourth draft method defined entirely in this file, registered from here, goes through the
package unchanged: `python -m specforge_k25.train` (a subprocess, resumed with train.resume=auto),
export and load, the memory plan and the method comparison, and the eval's replay. No file under
specforge_k25/ names it (tests/test_architecture.py checks that the shared code names no method).

The head is MTP-style: it reads only the target's final hidden state (zero capture points,
`target.aux_layers=[]`): token x[t+2] from the final state at t and the embedding of x[t+1],
through one linear layer and a norm, with the target's own lm_head."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from specforge_k25.draft.export_folder import shape_problems
from specforge_k25.draft.objective import LossResult
from specforge_k25.draft.method import DraftBatch, DraftMethod, Serving
from specforge_k25.draft.layers import RMSNorm
from specforge_k25.draft.registry import METHODS, register
from specforge_k25.draft.spec import DraftSpec

ROOT = Path(__file__).resolve().parents[2]
NAME = "mtp_plugin"
ARCHITECTURE = "PluginMTPHeadForTests"


@dataclass
class MTPSpec(DraftSpec):
    """draft=mtp_plugin: the shared sizes only (the head is one linear layer and a norm)."""


@dataclass
class MTPConfig:
    hidden_size: int  # H = Ht
    vocab_size: int  # V, the target's
    target_hidden_size: int
    rms_norm_eps: float = 1e-6

    @property
    def draft_vocab_size(self) -> int:  # proposes any target token (identity vocab maps)
        return self.vocab_size


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)

    def trainable_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens.")]

    def forward(self, final_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """final_hidden [B, T, H] (state at t), next_ids [B, T] (x[t+1]) -> logits [B, T, V] for x[t+2]."""
        h = self.fc(torch.cat([final_hidden, self.embed_tokens(next_ids).to(final_hidden.dtype)], -1))
        return self.norm(h) @ self.lm_head_weight.to(h.dtype).T


def _shifted(ids: torch.Tensor, n: int, fill) -> torch.Tensor:
    out = torch.full_like(ids, fill)
    out[:, : ids.shape[1] - n] = ids[:, n:]
    return out


def _counted(batch: DraftBatch) -> torch.Tensor:
    """[B, T]: positions t whose label x[t+2] exists and is supervised."""
    T = batch.input_ids.shape[1]
    t = torch.arange(T, device=batch.input_ids.device)
    return ((t[None] + 2) <= (batch.lengths[:, None] - 1)) & _shifted(batch.loss_mask, 2, False)


def mtp_plan():
    """The plan arithmetic (DraftMethod.plan) of the head: weights, what one step keeps, FLOPs."""
    def param_counts(cfg):
        H, V = cfg.hidden_size, cfg.vocab_size
        return {"fc": 2 * H * H, "norm": H, "embed_tokens (frozen)": V * H}

    def step_bytes(cfg, batch, seq_len, k, bf16):
        return batch * seq_len * 4 * (3 * cfg.hidden_size + cfg.vocab_size), batch * seq_len

    def saved_bytes(cfg, batch, seq_len, depth, bf16, checkpoint=False):
        per_token, mask = step_bytes(cfg, batch, seq_len, 0, bf16)
        return {"per_token": per_token, "attention_mask": mask, "total": per_token + mask}

    def backward_working_bytes(cfg, batch, seq_len, depth, bf16):
        return 2 * batch * seq_len * 4 * cfg.vocab_size

    def draft_step_flops(cfg, batch, seq_len, depth, checkpoint=False):
        N, H, V = batch * seq_len, cfg.hidden_size, cfg.vocab_size
        head = 3 * 2 * N * (2 * H * H + H * V)  # forward and backward
        return {"teacher": 0, "draft": head, "total": head}

    return SimpleNamespace(param_counts=param_counts, step_bytes=step_bytes, saved_bytes=saved_bytes,
                           backward_working_bytes=backward_working_bytes, draft_step_flops=draft_step_flops)


class MTPMethod(DraftMethod):
    name = NAME
    summary = "a test's MTP-style head (final hidden state only)"
    served_architecture = ARCHITECTURE
    model_class = MTPHead
    config_class = MTPConfig
    spec_class = MTPSpec
    needs_teacher = False
    needs_final_hidden = True
    plan = mtp_plan()

    def resolve_config(self, spec, target, num_aux: int = 0) -> MTPConfig:
        if num_aux:
            raise ValueError(f"the MTP head reads no capture point, {num_aux} given: target.aux_layers=[]")
        return MTPConfig(target.hidden_size, target.vocab_size, target.hidden_size, target.rms_norm_eps)

    def num_aux(self, cfg) -> int:
        return 0

    def new_model(self, cfg) -> MTPHead:
        return MTPHead(cfg)

    def attach_target(self, model, lm_head) -> None:
        model.lm_head_weight = lm_head

    def fsdp_units(self, model) -> list[str]:
        return ["fc", "norm"]

    def describe(self, cfg) -> str:
        return f"MTP head: H {cfg.hidden_size}, V {cfg.vocab_size}"

    def depth(self, spec, cfg) -> int:
        return 1

    def loss(self, model, batch: DraftBatch, spec, *, depth: int, normalizer=None, checkpoint: bool = False):
        counted = _counted(batch)
        logits = model(batch.final_hidden, _shifted(batch.input_ids, 1, 0)).float()  # [B, T, V]
        ce = F.cross_entropy(logits.transpose(1, 2), _shifted(batch.input_ids, 2, 0), reduction="none")
        ce_sum, n = (ce * counted).sum(), counted.sum()
        loss = ce_sum / (normalizer[0] if normalizer is not None else n).clamp(min=1)
        with torch.no_grad():
            correct = ((logits.argmax(-1) == _shifted(batch.input_ids, 2, 0)) & counted).sum()
            alpha = (torch.exp(-ce) * counted).sum()
        return LossResult(loss, (ce_sum / n.clamp(min=1)).detach()[None], n[None], correct[None], n[None], alpha[None])

    def loss_positions(self, batch: DraftBatch, depth: int) -> torch.Tensor:
        return _counted(batch).sum()[None]

    def serving_tensors(self, model, dtype):
        return {k: v.to(dtype) for k, v in (("fc.weight", model.fc.weight), ("norm.weight", model.norm.weight))}

    def serving_config(self, cfg, *, sglang_layer_ids, vllm_layer_ids, bos_token_id, eos_token_id, dtype) -> dict:
        return {"architectures": [ARCHITECTURE], **asdict(cfg), "torch_dtype": dtype, "eos_token_id": eos_token_id,
                "capture_points": list(vllm_layer_ids)}

    def validate_export(self, export_dir: Path) -> None:
        cfg = json.loads((export_dir / "config.json").read_text())
        H = cfg["hidden_size"]
        problems = shape_problems(load_file(str(export_dir / "model.safetensors")), {"fc.weight": (H, 2 * H),
                                                                                     "norm.weight": (H,)})
        if problems:
            raise ValueError("; ".join(problems))

    def load_export(self, export_dir: Path, embed_weight: torch.Tensor) -> MTPHead:
        cfg = json.loads((export_dir / "config.json").read_text())
        model = MTPHead(MTPConfig(**{k: cfg[k] for k in ("hidden_size", "vocab_size", "target_hidden_size",
                                                           "rms_norm_eps")}))
        model.load_state_dict(load_file(str(export_dir / "model.safetensors")), strict=False)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_weight.float())
        return model

    def servings(self, chains: list) -> list[Serving]:
        return [Serving("mtp 1", 2, 1, {}, {})]  # one proposal per verify step; no server runs it

    @torch.no_grad()
    def proposals(self, model, aux_hidden, input_ids, servings, final_hidden=None):
        logits = model(final_hidden[None].float(), _shifted(input_ids[None], 1, 0))[0]  # [T, V]
        return [logits.argmax(-1)[None] for _ in servings]


def register_plugin() -> DraftMethod:
    """Called by this test and by the training subprocess it starts (LAUNCH)."""
    return METHODS.get(NAME) or register(MTPMethod())


@pytest.fixture
def plugin():
    """The method registered for one test: the other tests of a worker see the package's methods only."""
    yield register_plugin()
    METHODS.pop(NAME, None)


# the training subprocess: the method registered, then the package's own CLI, unchanged
LAUNCH = ("import sys; sys.path.insert(0, {here!r}); import test_plugin_method as t; t.register_plugin(); "
          "sys.argv[0] = 'specforge_k25.train'; import runpy; runpy.run_module('specforge_k25.train', "
          "run_name='__main__', alter_sys=True)")


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", LAUNCH.format(here=str(Path(__file__).parent)), *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.e2e
def test_a_method_defined_in_a_test_trains_resumes_exports_plans_and_replays(tmp_path, plugin):
    from specforge_k25.config import compose_job
    from specforge_k25.eval.acceptance import draft_proposer, replay
    from specforge_k25.export.serving import load_exported_draft
    from specforge_k25.plan import facts_from_folder, plan_memory
    from specforge_k25.plan.choose import compare_methods
    from specforge_k25.target_engine.hf_config import load_embedding_and_head
    from specforge_k25.target_engine.hf_reference import HFTarget
    from specforge_k25.target_engine.models import resolve_target_path

    method = plugin
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    common = [f"draft={NAME}", "target.aux_layers=[]", "data.num_samples=12", "data.heldout_samples=2",
              "data.max_length=64", "train.batch_size=2", "train.checkpoint_every=3", "train.keep_checkpoints=2",
              "train.logger=none", "train.progress=false", "train.lr=1e-2", "train.eval_every=null"]
    out = _train(*common, f"train.out_dir={run}")
    assert "MTP head" in out.stdout  # the run's plan describes the plug-in's model
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6
    start, end = summary["eval"]["start"], summary["eval"]["end"]
    assert end["acc_0"] > start["acc_0"]  # it learns

    # a resume from the step-3 checkpoint ends where the uninterrupted run ended, bit for bit
    shutil.copytree(run, resumed)
    checkpoints = sorted((resumed / "checkpoints").iterdir())
    shutil.rmtree(checkpoints[-1])
    shutil.rmtree(resumed / "export")
    out = _train(*common, f"train.out_dir={resumed}", "train.resume=auto")
    assert "resum" in out.stdout.lower()
    for name in ("fc.weight", "norm.weight"):
        assert torch.equal(load_file(str(run / "export" / "model.safetensors"))[name],
                           load_file(str(resumed / "export" / "model.safetensors"))[name]), name

    # export and load: the method found by the folder's architecture
    job = compose_job(common)
    model_path = resolve_target_path(job.target)
    embed, lm_head = load_embedding_and_head(model_path)
    head = load_exported_draft(run / "export", embed, lm_head)
    assert type(head) is MTPHead and head.lm_head_weight.data_ptr() == lm_head.data_ptr()

    # the plan: this method's arithmetic in the memory plan and a row in the method comparison
    facts = facts_from_folder(model_path)
    plan = plan_memory(compose_job([*common, "+hw=b300x8", "hw.trainer_layout=dedicated"]), facts)  # per GPU
    assert plan.method is method and plan.draft.hidden_size == facts.hidden_size
    tokens, H = job.train.batch_size * job.data.max_length, facts.hidden_size  # the batch it keeps: ids, mask, final
    assert plan.gpu(0).get("batch: aux fp32 [B,T,0Ht] + final [B,T,Ht] fp32") == 2 * tokens * (8 + 1 + 4 * H)  # loss, optimizer
    rows = {r.method: r for r in compare_methods(job, facts)}
    assert NAME in rows and not rows[NAME].refused and rows[NAME].trainable_params == 2 * facts.hidden_size ** 2 + \
        facts.hidden_size

    # the eval's replay (eval/run.py asks the method for its proposals on the target's states of
    # an output): the proposals are the head's own argmax at every root
    ids = torch.arange(5, 25)
    states = HFTarget(model_path, capture_points=[]).forward([ids])
    assert states.aux_hidden.shape == (len(ids), 0)
    final = states.final_hidden
    (proposals,) = method.proposals(head, states.aux_hidden, ids, method.servings([]), final)
    expected = (head(final[None].float(), torch.roll(ids, -1)[None])[0]).argmax(-1)
    assert torch.equal(proposals[0, :-1], expected[:-1])
    completion, steps = replay(ids.tolist(), 4, draft_proposer(proposals))
    assert completion == len(ids) - 4 and 0 < steps <= completion
