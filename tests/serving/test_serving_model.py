"""The serving cost model's properties (specforge_k25/serving): more acceptance never predicts less
speedup, a verify step never costs less than a decode step, the users' calibration case on
8x RTX PRO 6000 and the shape of the speedup against concurrency (docs/PERFORMANCE.md §9)."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from specforge_k25.plan import KIMI_K25
from specforge_k25.serving import per_position_from_ratio
from specforge_k25.serving.commands import vllm_schedule
from specforge_k25.serving.cost import Node, target_step, uniform_distinct
from specforge_k25.serving.predict import (acceptance_length, best_per_concurrency, predict_all, predict_one,
                                           settings_for)
from specforge_k25.serving.sources import acceptance_of_folder

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]
KIMI_HEAD = [0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45]  # AL 2.72 at 3/1/4: public Kimi heads' MT-bench range


@pytest.fixture(scope="module")
def jobs():
    from specforge_k25.serving.config import compose_serving

    return {hw: compose_serving([f"+hw={hw}", "target=kimi_k25"]) for hw in ("rtxpro6000x8", "b300x8")}


def _uniform(facts=KIMI_K25):
    return lambda window, c: uniform_distinct(facts, window, c)


def _shape(job):
    from specforge_k25.serving.sources import draft_shape

    return draft_shape(job, KIMI_K25, "eagle3")


def test_more_acceptance_never_predicts_less_speedup(jobs):
    rng = random.Random(0)
    for hw, job in jobs.items():
        node, shape = Node.of(job.hw), _shape(job)
        for _ in range(40):
            acc = [rng.random() for _ in range(rng.randint(1, 7))]
            i = rng.randrange(len(acc))
            more = list(acc)
            more[i] = min(1.0, acc[i] + rng.random() * (1 - acc[i]))
            s = settings_for(rng.choice(["eagle3", "dflash", "ngram"]), [rng.randint(1, 8)])[0]
            c, ctx = rng.choice(CONCURRENCY), rng.choice([512, 4096, 32768])
            lo = predict_one(KIMI_K25, node, _uniform(), s, shape, acc, c, ctx)
            hi = predict_one(KIMI_K25, node, _uniform(), s, shape, more, c, ctx)
            assert hi.speedup >= lo.speedup, (hw, s, c, ctx, acc, more)
            assert hi.acceptance_length >= lo.acceptance_length


def test_verify_step_never_costs_less_than_decode(jobs):
    for job in jobs.values():
        node = Node.of(job.hw)
        for facts in (KIMI_K25, replace(KIMI_K25, n_routed_experts=0, num_moe_layers=0)):  # MoE and dense
            for c in CONCURRENCY:
                for ctx in (1, 4096, 131072):
                    decode = target_step(facts, node, c, 1, ctx, uniform_distinct(facts, 1, c)).total
                    for tokens in range(2, 17):
                        verify = target_step(facts, node, c, tokens, ctx, uniform_distinct(facts, tokens, c)).total
                        assert verify >= decode, (job.hw.name, facts.n_routed_experts, c, ctx, tokens)


def test_settings_from_the_methods_servings():
    chain, block = settings_for("eagle3", [3])[0], settings_for("dflash", [3])[0]
    assert (chain.label, chain.forwards, chain.tokens_per_forward, chain.extend) == ("eagle3 3/1/4", 3, 1, True)
    assert (block.label, block.forwards, block.tokens_per_forward, block.extend) == ("dflash block 4", 1, 4, False)
    assert settings_for("ngram", [5])[0].forwards == 0


def test_acceptance_length_by_hand():
    assert acceptance_length([0.5, 0.5], 2) == pytest.approx(1.75)
    assert acceptance_length([0.5], 3) == pytest.approx(1.875)  # the last rate repeated
    a = per_position_from_ratio(0.2, 5)[0]
    assert sum(a ** j for j in range(1, 6)) == pytest.approx(1.0, abs=1e-9)  # 20 % of 5 drafted = 1 accepted


def test_calibration_users_ngram_slower_on_rtxpro6000(jobs):
    """The users' node: all-reduce 51.5 % of a decode step (one request, context 4096) and prompt
    lookup at 17-31 % of 5 drafted tokens accepted slower than no speculation, at the 8 concurrent
    requests they are taken to have served (docs/PERFORMANCE.md §9)."""
    job = jobs["rtxpro6000x8"]
    node = Node.of(job.hw)
    decode = target_step(KIMI_K25, node, 1, 1, 4096, uniform_distinct(KIMI_K25, 1, 1))
    assert decode.allreduce_s / decode.total == pytest.approx(0.515, abs=0.005)
    for ratio in (0.17, 0.24, 0.31):
        p = predict_one(KIMI_K25, node, _uniform(), settings_for("ngram", [5])[0], None, per_position_from_ratio(ratio, 5), 8,
                        4096)
        assert 0.65 < p.speedup < 1.0, (ratio, p.speedup)


def test_shape_against_concurrency(jobs):
    """MoE on PCIe: the gain dips where a verify step's drafted tokens bring experts a decode step
    does not read (a few requests), then rises again at medium batch where the decode step already
    reads most experts, then falls as compute and all-reduce bytes grow. A dense target has no
    expert term: its gain only falls with concurrency."""
    job = jobs["rtxpro6000x8"]
    node, shape = Node.of(job.hw), _shape(job)
    s = settings_for("eagle3", [3])
    moe = {p.concurrency: p.speedup for p in predict_all(KIMI_K25, node, _uniform(), s, shape, KIMI_HEAD, CONCURRENCY,
                                                         [4096])}
    dip = min(moe, key=moe.get)
    assert 2 <= dip <= 16 and moe[64] > moe[dip] + 0.2 and moe[256] < max(moe[c] for c in (32, 64, 128))
    dense = replace(KIMI_K25, n_routed_experts=0, num_moe_layers=0)
    flat = [p.speedup for p in predict_all(dense, node, _uniform(dense), s, shape, KIMI_HEAD, CONCURRENCY, [4096])]
    assert all(a >= b - 1e-9 for a, b in zip(flat, flat[1:])), flat


def test_best_setting_off_and_vllm_schedule(jobs):
    node, shape = Node.of(jobs["rtxpro6000x8"].hw), _shape(jobs["rtxpro6000x8"])
    settings = settings_for("eagle3", [1, 3, 5])
    preds = predict_all(KIMI_K25, node, _uniform(), settings, shape, KIMI_HEAD, CONCURRENCY, [4096])
    best = best_per_concurrency(preds, 4096)
    assert all(b is not None and b.speedup > 1 for b in best.values())
    weak = best_per_concurrency(predict_all(KIMI_K25, node, _uniform(), settings, shape, [0.05], CONCURRENCY, [4096]),
                                4096)
    assert set(weak.values()) == {None}  # nothing pays: "off" everywhere
    schedule = vllm_schedule(best)
    assert schedule[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))
    assert schedule[-1][1] == CONCURRENCY[-1]
    for c, b in best.items():  # every concurrency gets its best drafted tokens
        assert next(k for lo, hi, k in schedule if lo <= c <= hi) == b.drafted
    assert vllm_schedule({1: best[1], 8: None})[-1] == [8, 8, 0]


def test_cli_json_and_bad_input(tmp_path, capsys):
    from specforge_k25.serving.__main__ import main

    out = tmp_path / "p.json"
    assert main(["+hw=rtxpro6000x8", "serving.method=ngram", "serving.acceptance=[0.5,0.4]", "serving.depths=[2,5]",
                 "serving.concurrency=[1,8]", "serving.context=[1024,8192]", f"serving.out={out}"]) == 0
    data = json.loads(out.read_text())
    assert len(data["predictions"]) == 2 * 2 * 2
    assert {"concurrency", "context", "setting", "speedup"} <= set(data["predictions"][0])
    assert (tmp_path / "p.png").is_file()
    printed = capsys.readouterr().out
    assert "--speculative-algorithm NGRAM" in printed or "without speculation" in printed
    assert main(["+hw=rtxpro6000x8", "serving.acceptance=[1.5]"]) == 2
    assert main(["serving.acceptance=[0.5]"]) == 2  # the cpu profile has no serving constants
    err = capsys.readouterr().err
    assert "rates must lie in [0, 1]" in err and "+hw=rtxpro6000x8" in err


def test_acceptance_from_run_and_eval_folders(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"target": "smollm2", "eval": {"end": {
        "acc_0": 0.5, "acc_1": 0.25, "alpha_0": 0.9, "tau_sim": 1.625}}}))
    got = acceptance_of_folder(run)
    assert got.rates == [0.5, 0.25] and got.target == "smollm2"
    (run / "export" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert acceptance_of_folder(run / "export").rates == [0.5, 0.25]
    assert acceptance_of_folder(run / "export").method == "eagle3"
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "eval.json").write_text(json.dumps({"heads": {"trained": {"method": "dflash"}}, "rows": [
        {"method": "trained", "chain": "block 4", "prompt_set": "all", "acc": [0.6, 0.3, 0.1]},
        {"method": "trained", "chain": "block 2", "prompt_set": "all", "acc": [0.7]},
        {"method": "ngram", "chain": "3/1/4", "prompt_set": "all", "al_replay": 1.2}]}))
    got = acceptance_of_folder(ev)
    assert got.rates == [0.6, 0.3, 0.1] and got.method == "dflash"


def test_routing_measured_only_for_the_predicted_target(tmp_path):
    import torch

    from specforge_k25.serving.cost import ServingError
    from specforge_k25.serving.sources import Acceptance, routing_for
    from specforge_k25.target_engine.routing import RoutingCounts

    counts = RoutingCounts([1, 2], num_experts=4, top_k=1, max_window=3)
    counts.add({1: torch.tensor([[0], [1], [1], [2]]), 2: torch.tensor([[3], [3], [3], [0]])}, [4])
    counts.save(tmp_path)
    acc = Acceptance([0.5], None, "test", target="tiny_deepseek", folder=tmp_path)
    measured, note = routing_for("auto", KIMI_K25, acc, "tiny_deepseek")
    assert "measured" in note and measured(2, 3) == pytest.approx(float(counts.expected_distinct(2, 3).sum()))
    with pytest.raises(ServingError, match="up to 3 tokens"):
        measured(4, 1)
    uniform, note = routing_for("auto", KIMI_K25, acc, "kimi_k25")
    assert "uniform" in note and "tiny_deepseek" in note and uniform(2, 3) == uniform_distinct(KIMI_K25, 2, 3)
    assert "uniform" in routing_for("uniform", KIMI_K25, acc, "tiny_deepseek")[1]
