"""The target side: SGLang's captured hidden states vs HF transformers, and layer-id conventions."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specforge_k25.target_engine.hf_config import load_embedding_and_head, read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import (
    DEEPSEEK_RULE,
    LLAMA_RULE,
    capture_points_of_sglang_ids,
    default_capture_points,
    layer_id_rule,
    sglang_layer_ids,
    validate_capture_points,
)
from specforge_k25.target_engine.sampling import Regeneration
from specforge_k25.target_engine.sglang_engine import packed_aux


# K aux states, one per capture point. SmolLM2 (Llama rule: SGLang hands a list of K tensors)
# captures K=5 points that include its default [2, 15, 27], so the default run's states are among
# those checked; the tiny DeepSeek (one packed [N, K*Ht]) captures K=2. Its default three are
# checked against HF by test_target_tp.py, the tiny Kimi's by test_kimi_target.py.
CAPTURES = {"smollm2": [2, 8, 15, 22, 27], "tiny_deepseek": [3, 6]}


# One engine process per target: the batches one forward each, as the stream's target process runs
# them, then the chunked prefill of a batch of two sequences (hw.target_prefill_chunk), so the
# chunked states are checked against the same engine's one-forward states at one engine start.
_CAPTURE_PROBE = """
    import json, sys, torch
    from pathlib import Path
    from specforge_k25.target_engine.base import CPU_MEM_FRACTION_STATIC
    from specforge_k25.target_engine.hf_config import read_target_info
    from specforge_k25.target_engine.sampling import Regeneration
    from specforge_k25.target_engine.sglang_engine import SGLangTarget

    if __name__ == "__main__":
        path, points, io = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        job = torch.load(io)
        job["regen"] = job["regen"] and Regeneration(**job["regen"])
        target = SGLangTarget(path, read_target_info(path).architecture, points, num_threads=2,
                              mem_fraction_static=CPU_MEM_FRACTION_STATIC, routing_dir=str(Path(io).parent))
        forwards = []  # tokens of each SGLang forward
        extend = target._runner.extend
        target._runner.extend = lambda reqs: forwards.append(sum(r.extend_len for r in reqs)) or extend(reqs)
        out = {"batches": [], "forwards": forwards}
        for batch in job["batches"]:
            res = target.forward(batch)
            out["batches"].append((res.lengths, res.aux_hidden, res.final_hidden))
        if job["regen"]:
            out["answers"] = target.generate(job["chunked"], job["budgets"], job["regen"])
        target.prefill_chunk = job["chunk"]
        res = target.forward(job["chunked"])
        out["chunked"] = (res.lengths, res.aux_hidden, res.final_hidden)
        if job["regen"]:
            out["chunked_answers"] = target.generate(job["chunked"], job["budgets"], job["regen"])
        target.close()  # writes the MoE routing counts beside `io`
        torch.save(out, io)
"""


def _engine_capture(path, points, batches, chunked, chunk, regen, budgets, tmp_path):
    """SGLang's states of `batches` (one forward each) and of the batch `chunked` prefilled `chunk`
    tokens per forward, from one engine in its own process; given `regen`, the answers to the
    prompts `chunked` with their prompts prefilled whole, then in chunks; and the tokens of every
    extend forward."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    import textwrap

    io, script = tmp_path / "capture.pt", tmp_path / "probe.py"
    torch.save({"batches": batches, "chunked": chunked, "chunk": chunk, "regen": regen and dataclasses.asdict(regen),
                "budgets": budgets}, io)
    script.write_text(textwrap.dedent(_CAPTURE_PROBE))
    run = subprocess.run([sys.executable, str(script), path, json.dumps(points), str(io)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(io)


def _worst(a, r):
    """max |diff| / (1e-4 * max(1, |ref|)). The spec is max |diff| <= 1e-4 in fp32. SmolLM2's
    residual stream has outlier channels of magnitude ~2.6e4, where one fp32 ulp is ~2e-3, so the
    bound is applied relative to the magnitude beyond 1; elsewhere this is the plain 1e-4 bound."""
    return ((a - r).abs() / (1e-4 * r.abs().clamp(min=1.0))).max().item()


@pytest.mark.engine
@pytest.mark.parametrize("target", ["smollm2", "tiny_deepseek"])
def test_sglang_hidden_states_equal_hf(target, request, tmp_path):
    """Aux (K capture points) and final post-norm states from SGLang == HF output_hidden_states, fp32;
    and chunked prefill: a batch of 41 + 23 tokens in forwards of 16 (the first sequence's tail
    shares a forward with the second's head, which its next forward continues) == the same
    engine's one forward of each == HF."""
    path = request.getfixturevalue(f"{target}_path")
    info = read_target_info(path)
    points = CAPTURES[target]
    K, H = len(points), info.hidden_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (23, 7, 41)]
    assert len(points) != 3
    if target == "smollm2":
        assert set(default_capture_points(info.num_layers)) <= set(points)
    # regeneration (on the MLA target only: ~5 s of SGLang extend calls per target on CI's CPUs)
    regen, budgets = (Regeneration(max_new_tokens=4, max_length=64), [4, 3]) if target == "tiny_deepseek" else (None, None)
    got = _engine_capture(path, points, [seqs[:2], seqs[2:]], [seqs[2], seqs[0]], 16, regen, budgets, tmp_path)
    # two batches whole; [two prompts (41 + 23) whole]; the same two sequences in forwards of 16;
    # [the prompts but their last tokens (40 + 22) in forwards of 16, then their last tokens together]
    assert got["forwards"] == ([30, 41, 64, 16, 16, 16, 16, 16, 16, 16, 14, 2] if regen else [30, 41, 16, 16, 16, 16])
    hf = HFTarget(path, points)
    if regen:  # prompts prefilled in chunks: the decode steps continue them to HF's greedy answers
        assert got["chunked_answers"] == got["answers"] == hf.generate([seqs[2], seqs[0]], budgets, regen)
    ref = hf.forward(seqs)
    aux = torch.cat([a for _, a, _ in got["batches"]])
    final = torch.cat([f for _, _, f in got["batches"]])
    assert [n for lengths, _, _ in got["batches"] for n in lengths] == [23, 7, 41]
    assert aux.shape == (71, K * H) and final.shape == (71, H)
    assert ref.aux_hidden.shape == aux.shape
    for name, a, r in (("aux", aux, ref.aux_hidden), ("final", final, ref.final_hidden)):
        worst = _worst(a, r)
        assert worst <= 1.0, f"{target} {name}: max |diff|/bound = {worst:.3g} (max |diff| {(a - r).abs().max():.3g})"
    # chunked prefill of [seq 2, seq 0]: the trainer receives their states in token order
    lengths, c_aux, c_final = got["chunked"]
    assert lengths == [41, 23]
    order = torch.cat([torch.arange(30, 71), torch.arange(0, 23)])
    for name, c, one, r in (("aux", c_aux, aux, ref.aux_hidden), ("final", c_final, final, ref.final_hidden)):
        one, r = one[order], r[order]
        print(f"{target} {name}: chunked vs one forward max |diff| {(c - one).abs().max():.3g} "
              f"(/bound {_worst(c, one):.3g}), chunked vs HF {(c - r).abs().max():.3g} (/bound {_worst(c, r):.3g})")
        assert _worst(c, one) <= 1.0, f"{target} {name}: chunked differs from one forward by {(c - one).abs().max():.3g}"
        assert _worst(c, r) <= 1.0, f"{target} {name}: chunked differs from HF by {(c - r).abs().max():.3g}"
    # and each captured block is exactly its configured layer's: the next layer's input does not match
    with torch.no_grad():
        hs = hf.model.model(seqs[0][None], output_hidden_states=True).hidden_states
    for k, p in enumerate(points):
        block = aux[:23, k * H:(k + 1) * H]
        assert torch.allclose(block, hs[p][0], atol=1e-3, rtol=1e-4), f"{target}: block {k} is not point {p}"
        assert not torch.allclose(block, hs[p + 1][0], atol=1e-3, rtol=1e-4), f"{target}: block {k} is point {p + 1}"
    # MoE routing counted online (target_engine/routing.py) over the prefilled batches only (the
    # decode steps not): == the windows of HF's own router, enumerated by brute force
    from specforge_k25.target_engine.routing import load_counts

    counts = load_counts(tmp_path)
    assert (counts is None) == (target == "smollm2")
    if counts is not None:
        _routing_equals_hf_brute_force(counts, hf.model, [seqs[0], seqs[1], seqs[2], seqs[2], seqs[0]])


def _routing_equals_hf_brute_force(counts, model, seqs):
    import itertools

    ids = {layer: [] for layer in counts.layers}
    hooks = [model.model.layers[layer].mlp.gate.register_forward_hook(
        lambda mod, args, out, layer=layer: ids[layer].append([set(t) for t in out[2].tolist()])) for layer in counts.layers]
    with torch.no_grad():
        for s in seqs:
            model.model(s[None])
    for h in hooks:
        h.remove()
    assert counts.tokens == sum(len(s) for s in seqs)
    for li, layer in enumerate(counts.layers):
        for m in range(1, counts.max_window + 1):
            windows = [set().union(*s[i:i + m]) for s in ids[layer] for i in range(len(s) - m + 1)]
            assert counts.expected_distinct(m, 1)[li].item() == pytest.approx(sum(map(len, windows)) / len(windows))
            if m in (1, 4):
                pairs = list(itertools.product(windows, repeat=2))
                assert counts.expected_distinct(m, 2)[li].item() == pytest.approx(
                    sum(len(a | b) for a, b in pairs) / len(pairs))


@pytest.mark.engine
def test_sglang_without_capture_points_gives_empty_aux_and_hf_final(tiny_deepseek_path, tmp_path):
    """Zero capture points (target.aux_layers=[], an MTP-style head): the engine starts without
    EAGLE-3 capture and returns aux [N, 0] beside the final post-norm state == HF's, one forward per
    batch and in chunks of 16 (the chunked path's buffers at width 0). The DeepSeek family (Kimi's
    code path); SmolLM2 runs with zero points end to end in tests/draft/test_plugin_method.py."""
    path = tiny_deepseek_path
    info = read_target_info(path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (23, 7, 41)]
    got = _engine_capture(path, [], [seqs[:2], seqs[2:]], [seqs[2], seqs[0]], 16, None, None, tmp_path)
    assert got["forwards"] == [30, 41, 16, 16, 16, 16]
    hf = HFTarget(path, [])
    ref = hf.forward(seqs)
    assert ref.aux_hidden.shape == (71, 0)
    with_points = HFTarget(path, CAPTURES["tiny_deepseek"]).forward(seqs).final_hidden
    assert torch.equal(ref.final_hidden, with_points)  # capturing nothing changes nothing else
    for lengths, aux, final in got["batches"]:
        assert aux.shape == (sum(lengths), 0) and final.shape == (sum(lengths), info.hidden_size)
    final = torch.cat([f for _, _, f in got["batches"]])
    assert _worst(final, ref.final_hidden) <= 1.0, f"final differs from HF by {(final - ref.final_hidden).abs().max():.3g}"
    lengths, c_aux, c_final = got["chunked"]
    assert lengths == [41, 23] and c_aux.shape == (64, 0)
    order = torch.cat([torch.arange(30, 71), torch.arange(0, 23)])
    assert _worst(c_final, final[order]) <= 1.0, f"chunked differs from one forward by {(c_final - final[order]).abs().max():.3g}"


def _sglang_captured_layers(model_cls_name: str, ids: list[int], num_layers: int) -> list[int]:
    """Ask SGLang's own `set_eagle3_layers_to_capture` which layers it captures for `ids`."""
    from specforge_k25.target_engine import sglang_cpu_compat

    sglang_cpu_compat.apply()
    if model_cls_name == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM as cls
    else:
        from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM as cls
    fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=num_layers),
                           model=SimpleNamespace())
    cls.set_eagle3_layers_to_capture(fake, ids)
    return list(fake.model.layers_to_capture)


@pytest.mark.parametrize("architecture,num_layers,expected_ids", [
    ("KimiK25ForConditionalGeneration", 61, [2, 30, 58]),  # Kimi-K2.5: inputs of 2, 30, 58
    ("DeepseekV3ForCausalLM", 8, [2, 4, 5]),  # the tiny DeepSeek
    ("LlamaForCausalLM", 30, [1, 14, 26]),  # SmolLM2
])
def test_exported_layer_ids_make_sglang_capture_the_trained_layers(architecture, num_layers, expected_ids):
    rule = layer_id_rule(architecture)
    points = default_capture_points(num_layers)
    ids = sglang_layer_ids(points, rule)
    assert ids == expected_ids
    sglang_model = "llama" if rule == LLAMA_RULE else "deepseek"
    assert _sglang_captured_layers(sglang_model, ids, num_layers) == points
    assert capture_points_of_sglang_ids(ids, rule) == points


def test_layer_id_rule_mirror_agrees_with_sglang():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        ids = sorted(torch.randperm(60, generator=g)[:3].add(1).tolist())
        for rule, name in ((LLAMA_RULE, "llama"), (DEEPSEEK_RULE, "deepseek")):
            assert capture_points_of_sglang_ids(ids, rule) == _sglang_captured_layers(name, ids, 61)
    # the public Kimi draft convention [1, 29, 57] captures the same layers as [2, 30, 58] on DeepSeek
    assert _sglang_captured_layers("deepseek", [1, 29, 57], 61) == [2, 30, 58]


@pytest.mark.parametrize("points", [[2, 40], [2, 9, 30, 44, 58], [5]])
def test_any_number_of_capture_points_is_what_sglang_captures(points):
    """set_eagle3_layers_to_capture takes a list of any length on both model families: the ids for
    K != 3 points make SGLang's own method capture exactly those K points."""
    for architecture, name in (("LlamaForCausalLM", "llama"), ("KimiK25ForConditionalGeneration", "deepseek")):
        ids = sglang_layer_ids(points, layer_id_rule(architecture))
        assert _sglang_captured_layers(name, ids, 61) == points
        assert capture_points_of_sglang_ids(ids, layer_id_rule(architecture)) == points


def test_engine_output_is_checked_against_the_capture_count():
    """What SGLang's hook hands over -> aux [N, K*Ht] in capture-point order; another count than the
    K points asked for is named, not passed on."""
    ht, n = 4, 3
    final = torch.zeros(n, ht)
    states = [torch.full((n, ht), float(k)) for k in range(5)]
    assert torch.equal(packed_aux(list(states), final, 5), torch.cat(states, -1))  # Llama: a list of K
    packed = torch.cat(states[:2], -1)
    assert packed_aux(packed, final, 2) is packed  # DeepSeek: packed already
    with pytest.raises(RuntimeError, match="captured 2 aux hidden states of width 4, the capture points ask for 3"):
        packed_aux(states[:2], final, 3)
    with pytest.raises(RuntimeError, match="captured 5 aux hidden states .* ask for 3"):
        packed_aux(torch.cat(states, -1), final, 3)


def test_setup_refuses_a_capture_count_the_draft_cannot_take(smollm2_path):
    """target.aux_layers of K != 3 points is refused for the EAGLE-3 head when the run is set up
    (prepare and the target spec of every node), naming the head and both counts; the default and
    any 3 points pass; the MLA head takes 5."""
    from specforge_k25.config import compose_job
    from specforge_k25.setup.target import capture_points, target_spec

    info = read_target_info(smollm2_path)
    assert capture_points(compose_job([]), info) == [2, 15, 27]
    assert capture_points(compose_job(["target.aux_layers=[3,9,20]"]), info) == [3, 9, 20]
    for layers, k in (("[2,15]", 2), ("[2,8,15,22,27]", 5)):
        job = compose_job([f"target.aux_layers={layers}"])
        for check in (lambda: capture_points(job, info), lambda: target_spec(job)):
            with pytest.raises(ValueError, match=rf"{k} capture points \(target.aux_layers\), but the EAGLE-3 head "
                                                 rf"\(fc over 3 x Ht.*takes exactly 3"):
                check()
    assert target_spec(compose_job([])).num_aux == 3
    # a method that reads any number of states takes them: the count is the method's to refuse
    mla = compose_job(["target.aux_layers=[2,8,15,22,27]", "draft=eagle3_mla"])
    assert capture_points(mla, info) == [2, 8, 15, 22, 27] and target_spec(mla).num_aux == 5


def test_capture_point_validation():
    assert validate_capture_points([2, 30, 58], 61) == [2, 30, 58]
    # any number K >= 0 of points: K is the number of aux states the stream carries ([]: none,
    # tests/target_engine/test_layers.py)
    assert validate_capture_points([2, 3], 61) == [2, 3]
    assert validate_capture_points([1, 2, 30, 40, 60], 61) == [1, 2, 30, 40, 60]
    for bad in ([2, 2, 5], [5, 3, 7], [0, 3, 5], [2, 3, 61], [4, 4], [9, 3]):
        with pytest.raises(ValueError):
            validate_capture_points(bad, 61)
    with pytest.raises(ValueError, match="layer 1"):
        sglang_layer_ids([1, 3, 5], DEEPSEEK_RULE)
    with pytest.raises(ValueError, match="not supported"):
        layer_id_rule("GPT2LMHeadModel")


def test_embedding_and_head_read_from_safetensors(smollm2_path, tiny_deepseek_path):
    """Only the two tensors are read; tied (SmolLM2) and untied (DeepSeek) heads both work."""
    from transformers import AutoModelForCausalLM

    for path in (smollm2_path, tiny_deepseek_path):
        embed, head = load_embedding_and_head(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert torch.equal(embed, model.model.embed_tokens.weight)
        assert torch.equal(head, model.lm_head.weight)
