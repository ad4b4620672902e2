"""Pipeline-parallel target stages (target_engine/sglang_pipeline.py): PP2 (and PP2 x TP2) equals the
one-process SGLang engine (TP1) and HF for the aux and final states, with a capture point that is the
first layer of stage 1 and chunked prefill; layout checks and the regeneration refusal.

The stage processes are started here directly (multiprocessing spawn, one per world rank, meeting
at a TCPStore as the stream's Rendezvous serves it); the stream's own wiring is tested elsewhere."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time

import pytest
import torch

from specforge_k25.target_engine.base import CPU_MEM_FRACTION_STATIC
from specforge_k25.target_engine.factory import TargetSpec, build_target, check_tp_layout
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget

LENGTHS = (23, 7, 41)
# 30-layer SmolLM2 splits 15 + 15 (SGLang's default), the 8-layer tiny DeepSeek 4 + 4: the middle
# point is the first layer of stage 1, whose input is rebuilt from stage 0's proxies.
POINTS = {"smollm2": [2, 15, 27], "tiny_deepseek": [2, 4, 6]}


def _inputs(path):
    info = read_target_info(path)
    g = torch.Generator().manual_seed(0)
    return info, [torch.randint(3, info.vocab_size, (n,), generator=g) for n in LENGTHS]


def _worst(a, r):
    """max |diff| / (1e-4 * max(1, |ref|)): <= 1 is fp32 agreement (see test_target.py)."""
    return ((a - r).abs() / (1e-4 * r.abs().clamp(min=1.0))).max().item()


def _rank(spec_fields: dict, pp_rank: int, tp_rank: int, batches, env: dict, out: str) -> None:
    """One world rank: build its stage, take the batches from world rank 0 (`share_batch`), forward
    them; the last stage's TP rank 0 saves what it returns, every rank what it knows of itself."""
    os.environ.update(env)
    torch.set_num_threads(1)
    spec = TargetSpec(**spec_fields)
    stage = build_target(spec, tp_rank=tp_rank, pp_rank=pp_rank)
    torch.set_num_threads(1)
    outputs = []
    i = 0
    while True:
        batch = stage.share_batch(batches[i] if pp_rank == tp_rank == 0 and i < len(batches) else None)
        if batch is None:
            break
        res = stage.forward(batch)
        assert (res is None) == (not stage.is_last_stage)
        outputs.append(res and (res.lengths, res.aux_hidden, res.final_hidden))
        i += 1
    refusal = None
    if spec.pp_size > 1:
        try:
            stage.generate([torch.arange(1, 5)], [1], None)
        except NotImplementedError as err:
            refusal = str(err)
    stage.close()
    torch.save({"outputs": outputs, "layers": getattr(stage, "layers", None), "last": stage.is_last_stage,
                "own": getattr(stage, "own_capture_layers", None), "refusal": refusal}, f"{out}.{pp_rank}.{tp_rank}")


def _run_pipeline(tmp_path, path, points, batches, *, pp_size=2, tp_size=1, prefill_chunk=None, timeout_s=240):
    """All pp_size * tp_size ranks of a pipeline target over `batches`; {(pp, tp): what the rank saved}."""
    from specforge_k25.stream.target_stream import Rendezvous

    info = read_target_info(path)
    spec = TargetSpec(engine="sglang", model_path=path, architecture=info.architecture, capture_points=points,
                      pp_size=pp_size, tp_size=tp_size, num_threads=1, prefill_chunk=prefill_chunk,
                      mem_fraction_static=CPU_MEM_FRACTION_STATIC, max_total_tokens=512, dist_timeout=timeout_s)
    check_tp_layout(spec)
    rendezvous = Rendezvous(timeout_s)
    env = {**rendezvous.env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ctx = mp.get_context("spawn")
    out = str(tmp_path / "rank")
    procs = {(p, t): ctx.Process(target=_rank, args=(dataclasses.asdict(spec), p, t, batches, env, out))
             for p in range(pp_size) for t in range(tp_size)}
    for proc in procs.values():
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        for key, proc in procs.items():
            proc.join(max(1.0, deadline - time.monotonic()))
            assert proc.exitcode == 0, f"rank (stage, tp) {key} ended with {proc.exitcode}"
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
    return {key: torch.load(f"{out}.{key[0]}.{key[1]}") for key in procs}


def _one_process(path, points, batches, tmp_path, prefill_chunk=None):
    """The one-process SGLang engine (TP1, SGLangTarget) in a spawned process, over the same batches."""
    return _run_pipeline(tmp_path, path, points, batches, pp_size=1, prefill_chunk=prefill_chunk)[(0, 0)]


def _cat(outputs):
    assert [n for lengths, _, _ in outputs for n in lengths] == list(LENGTHS)
    return torch.cat([a for _, a, _ in outputs]), torch.cat([f for _, _, f in outputs])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per target: (TP1 states, HF states) of the three sequences."""
    cache = {}

    def get(target, path):
        if target not in cache:
            _, seqs = _inputs(path)
            tp1 = _cat(_one_process(path, POINTS[target], [seqs[:2], seqs[2:]], tmp_path_factory.mktemp(target))["outputs"])
            ref = HFTarget(path, POINTS[target]).forward(seqs)
            cache[target] = tp1, (ref.aux_hidden, ref.final_hidden)
        return cache[target]

    return get


def _check(name, got, tp1, ref):
    for part, a, b, r in zip(("aux", "final"), got, tp1, ref):
        assert a.shape == b.shape == r.shape
        print(f"{name} {part}: vs TP1 max |diff| {(a - b).abs().max():.3g} (/bound {_worst(a, b):.3g}), "
              f"vs HF {(a - r).abs().max():.3g} (/bound {_worst(a, r):.3g})")
        assert _worst(a, b) <= 1.0, f"{name} {part}: differs from TP1 by {(a - b).abs().max():.3g}"
        assert _worst(a, r) <= 1.0, f"{name} {part}: differs from HF by {(a - r).abs().max():.3g}"


@pytest.mark.engine
@pytest.mark.parametrize("target,chunk", [("smollm2", None)])
def test_pp2_states_equal_tp1_and_hf(target, chunk, request, tmp_path, references):
    """Two stages, two batches shared by world rank 0: the last stage returns every batch's aux and
    final states (stage 0's aux travelled with the proxies), equal to the one-process engine's and
    HF's. (The tiny DeepSeek with chunked prefill: the PP2 x TP2 test below; through the stream and
    the Kimi-K2.5 wrapper: tests/target_engine/test_kimi_target.py.)"""
    path = request.getfixturevalue(f"{target}_path")
    info, seqs = _inputs(path)
    t0 = time.perf_counter()
    ranks = _run_pipeline(tmp_path, path, POINTS[target], [seqs[:2], seqs[2:]], prefill_chunk=chunk)
    print(f"{target} PP2 (start + 2 batches): {time.perf_counter() - t0:.1f} s")
    first, last = ranks[(0, 0)], ranks[(1, 0)]
    half = info.num_layers // 2
    assert (first["layers"], last["layers"]) == ((0, half), (half, info.num_layers))
    assert first["own"] == [p for p in POINTS[target] if p < half] and half in last["own"]
    assert not first["last"] and last["last"] and first["outputs"] == [None, None]
    assert "regeneration (data.regenerate) with a pipeline-parallel target is not supported yet" in first["refusal"]
    _check(f"{target} PP2", _cat(last["outputs"]), *references(target, path))


@pytest.mark.engine
def test_pp2_tp2_states_equal_tp1_and_hf(tiny_deepseek_path, tmp_path, references):
    """Four ranks: two stages of two TP ranks (SGLang sends 1/tp of each tensor between the stages
    and all-gathers it), prefilled in forwards of 16 tokens: both TP ranks of the last stage return
    the states of TP1 and HF."""
    info, seqs = _inputs(tiny_deepseek_path)
    t0 = time.perf_counter()
    ranks = _run_pipeline(tmp_path, tiny_deepseek_path, POINTS["tiny_deepseek"], [seqs[:2], seqs[2:]],
                          tp_size=2, prefill_chunk=16)
    print(f"tiny_deepseek PP2 x TP2 (start + 2 batches): {time.perf_counter() - t0:.1f} s")
    tp1, ref = references("tiny_deepseek", tiny_deepseek_path)
    for t in (0, 1):
        assert ranks[(0, t)]["outputs"] == [None, None]
        _check(f"PP2xTP2 rank (1, {t})", _cat(ranks[(1, t)]["outputs"]), tp1, ref)


def _spec(**kw):
    return TargetSpec(engine="sglang", model_path="m", architecture="LlamaForCausalLM", capture_points=[1, 2, 3], **kw)


def test_pp_layout_checks(tiny_deepseek_path):
    info = read_target_info(tiny_deepseek_path)
    spec = dict(engine="sglang", model_path=tiny_deepseek_path, architecture=info.architecture, capture_points=[2, 4])
    check_tp_layout(TargetSpec(**spec, pp_size=info.num_layers, tp_size=2))
    assert TargetSpec(**spec, pp_size=4, tp_size=2).world_size == 8 and _spec().world_size == 1
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        check_tp_layout(TargetSpec(**spec, pp_size=info.num_layers + 1))
    with pytest.raises(ValueError, match="pipeline stages 0: must be >= 1"):
        check_tp_layout(_spec(pp_size=0))
    with pytest.raises(ValueError, match="has no pipeline stages.*needs the sglang engine"):
        check_tp_layout(TargetSpec(**{**spec, "engine": "hf"}, pp_size=2))
    with pytest.raises(ValueError, match="runs on one node"):
        check_tp_layout(_spec(pp_size=2, tp_size=2, nnodes=2, dist_init_addr="h:1"))
    check_tp_layout(_spec(tp_size=2))  # pp_size 1: the model's config is not read


def test_pp_stage_refuses_regeneration_and_one_stage():
    """Refusals that need no engine: regeneration (the stages compute no logits) and pp_size < 2."""
    from specforge_k25.target_engine.sglang_pipeline import SGLangPipelineStage

    stage = object.__new__(SGLangPipelineStage)  # generate needs nothing the engine builds
    with pytest.raises(NotImplementedError, match=r"regeneration \(data.regenerate\) with a pipeline-parallel "
                                                  r"target is not supported yet: "):
        stage.generate([torch.arange(4)], [2], None)
    with pytest.raises(ValueError, match="a pipeline has >= 2 stages"):
        SGLangPipelineStage("m", "LlamaForCausalLM", [1, 2], pp_size=1)
