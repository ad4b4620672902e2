"""A fourth draft method defined outside the package (tests/fixtures/mtp_method.py, the template of
docs/NEW_METHOD.md), registered from here, goes through the package unchanged: `python -m
specforge_k25.train` (a subprocess) with no capture-point override (the method's default: none),
export and load, the memory plan and the method comparison, and `specforge_k25.eval`, which replays
a head no server runs. No file under specforge_k25/ names it (tests/test_architecture.py checks
that the shared code names no method)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_method import NAME, MTPHead, register_plugin  # tests/fixtures
from specforge_k25.draft.registry import METHODS

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def plugin():
    """The method registered for one test: the other tests of a worker see the package's methods only."""
    yield register_plugin()
    METHODS.pop(NAME, None)


# the training subprocess: the method registered, then the package's own CLI, unchanged
LAUNCH = ("import sys; sys.path.insert(0, {here!r}); import mtp_method as t; t.register_plugin(); "
          "sys.argv[0] = 'specforge_k25.train'; import runpy; runpy.run_module('specforge_k25.train', "
          "run_name='__main__', alter_sys=True)")


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", LAUNCH.format(here=str(FIXTURES)), *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_the_summary_counts_the_bytes_the_ring_carries_per_token():
    """DraftMethod.streamed_bytes (the run summary's hidden-state bytes) == a ring's slot bytes per
    token for each method's capture count: 0 (the plug-in's default), 3, 5 and 6 states."""
    from specforge_k25.plan import KIMI_K25, resolve_draft
    from specforge_k25.stream.ring import SlotRing

    method = register_plugin()
    try:
        ctx = torch.multiprocessing.get_context("spawn")
        for name, spec, k in ((NAME, method.spec_class(), 0), ("eagle3", None, 3), ("eagle3_mla", None, 5),
                              ("dflash", None, 6)):
            spec = spec or METHODS[name].spec_class()
            cfg = resolve_draft(spec, KIMI_K25, k)
            for dtype in (torch.float32, torch.bfloat16):
                ring = SlotRing(ctx, 1, 4, KIMI_K25.hidden_size, dtype, num_aux=METHODS[name].num_aux(cfg))
                per_token = (ring.aux[0].nbytes + ring.final[0].nbytes) // 4
                assert METHODS[name].streamed_bytes(cfg, dtype.itemsize) == per_token == \
                    (k + 1) * KIMI_K25.hidden_size * dtype.itemsize, (name, dtype)
    finally:
        METHODS.pop(NAME, None)


@pytest.mark.e2e
def test_a_method_defined_outside_trains_exports_plans_and_evaluates(tmp_path, plugin):
    from specforge_k25.config import compose_job
    from specforge_k25.eval.acceptance import draft_proposer, replay
    from specforge_k25.eval.run import run_eval
    from specforge_k25.export.serving import load_exported_draft
    from specforge_k25.plan import facts_from_folder, plan_memory
    from specforge_k25.plan.choose import compare_methods
    from specforge_k25.setup.run import prepare
    from specforge_k25.stream.ring import SlotRing
    from specforge_k25.target_engine.hf_config import load_embedding_and_head
    from specforge_k25.target_engine.hf_reference import HFTarget

    method = plugin
    run = tmp_path / "run"
    common = [f"draft={NAME}", "data.num_samples=12", "data.heldout_samples=2", "data.max_length=64",
              "train.batch_size=2", "train.logger=none", "train.progress=false", "train.lr=1e-2", "train.eval_every=null"]
    out = _train(*common, f"train.out_dir={run}")  # no target.aux_layers: the method's default (none)
    assert f"{NAME}: hidden_size" in out.stdout  # the run's plan describes the plug-in's model (the base's describe)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6
    start, end = summary["eval"]["start"], summary["eval"]["end"]
    assert end["acc_0"] > start["acc_0"]  # it learns

    # the run captured nothing, and its summary counts the bytes the ring carried: one final state per
    # token (not four), for the trained tokens and the held-out ones at the start and end evals
    job = compose_job(common)
    setup = prepare(job)
    assert setup.capture_points == [] and setup.sglang_capture_ids == []
    H, dtype = setup.info.hidden_size, getattr(torch, job.hw.target_dtype)
    ring = SlotRing(torch.multiprocessing.get_context("spawn"), 1, 8, H, dtype, num_aux=len(setup.capture_points))
    ring_bytes_per_token = (ring.aux[0].nbytes + ring.final[0].nbytes) // 8
    streamed = summary["tokens_trained"] + 2 * sum(len(s.input_ids) for s in setup.data.heldout)
    assert summary["disk"]["hidden_state_bytes_streamed_in_memory"] == streamed * ring_bytes_per_token

    # export and load: the method found by the folder's architecture
    embed, lm_head = load_embedding_and_head(setup.model_path)
    head = load_exported_draft(run / "export", embed, lm_head)
    assert type(head) is MTPHead and head.lm_head_weight.data_ptr() == lm_head.data_ptr()

    # the plan: this method's arithmetic in the memory plan, under its own labels, and a row in the method comparison
    facts = facts_from_folder(setup.model_path)
    plan = plan_memory(compose_job([*common, "+hw=b300x8", "hw.trainer_layout=dedicated"]), facts)  # per GPU
    assert plan.method is method and plan.draft.hidden_size == facts.hidden_size
    tokens, H = job.train.batch_size * job.data.max_length, facts.hidden_size  # the batch it keeps: ids, mask, final
    gpu0 = plan.gpu(0)
    assert gpu0.get("batch: aux fp32 [B,T,0Ht] + final [B,T,Ht] fp32") == 2 * tokens * (8 + 1 + 4 * H)  # loss, optimizer
    assert gpu0.get("draft saved: per-token tensors (K steps)") == method.plan.saved_bytes(
        plan.draft, job.train.batch_size, job.data.max_length, 1, True)["per_token"]
    assert not [i.name for i in gpu0.items if "TTT" in i.name]
    rows = {r.method: r for r in compare_methods(job, facts)}
    assert NAME in rows and not rows[NAME].refused and rows[NAME].trainable_params == 2 * facts.hidden_size ** 2 + \
        facts.hidden_size

    # the eval's replay (eval/run.py asks the method for its proposals on the target's states of
    # an output): the proposals are the head's own argmax at every root
    ids = torch.arange(5, 25)
    states = HFTarget(setup.model_path, capture_points=[]).forward([ids])
    assert states.aux_hidden.shape == (len(ids), 0)
    final = states.final_hidden
    (proposals,) = method.proposals(head, states.aux_hidden, ids, method.servings([]), final)
    expected = (head(final[None].float(), torch.roll(ids, -1)[None])[0]).argmax(-1)
    assert torch.equal(proposals[0, :-1], expected[:-1])
    completion, steps = replay(ids.tolist(), 4, draft_proposer(proposals))
    assert completion == len(ids) - 4 and 0 < steps <= completion

    # `specforge_k25.eval` on it: no SGLang serving, so the replay only, written to eval.json
    out_dir = tmp_path / "eval"
    ev = compose_job([*common, f"export_dir={run / 'export'}", "eval.methods=[nospec,trained]",
                      "eval.prompt_sets=[mtbench]", "eval.num_prompts=2", "eval.max_new_tokens=8",
                      "eval.chains=[[3,1,4]]", f"eval.output={out_dir}"], config_name="eval")
    results = run_eval(ev, out_dir)
    assert results["heads"]["trained"]["method"] == NAME and json.loads((out_dir / "eval.json").read_text()) == results
    rows = {(r["method"], r["chain"], r["prompt_set"]): r for r in results["rows"]}
    trained = rows[("trained", "mtp 1", "all")]
    assert 1.0 <= trained["al_replay"] <= 2.0 and "al_sglang" not in trained and len(trained["acc"]) == 1
    assert rows[("nospec", "-", "all")]["completion_tokens"] == 2 * 8  # the greedy reference ran
