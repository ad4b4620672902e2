"""The distinct-expert counts (target_engine/routing.py): exact on hand-made routing against a
brute-force enumeration of windows with Python sets, and on the HF reference router of the tiny
DeepSeek target."""
from __future__ import annotations

import itertools

import pytest
import torch

from specforge_k25.target_engine.routing import RoutingCounts, load_counts, moe_layout


def brute_force(seqs: list[list[tuple[int, ...]]], m: int) -> list[set]:
    """Every window of m consecutive tokens of every sequence, as the set of experts it touches."""
    return [set().union(*s[i:i + m]) for s in seqs for i in range(len(s) - m + 1)]


# Two sequences over 6 experts, top-2; layer 1 repeats experts, so windows overlap in experts
HAND = {
    0: [[(0, 1), (1, 2), (3, 4), (0, 5)], [(2, 3), (2, 3), (4, 5)]],
    1: [[(0, 1), (0, 1), (0, 1), (2, 3)], [(4, 5), (0, 1), (4, 5)]],
}


def _counts(routing: dict, max_window: int = 4) -> RoutingCounts:
    counts = RoutingCounts(sorted(routing), num_experts=6, top_k=2, max_window=max_window)
    lengths = [len(s) for s in routing[0]]
    counts.add({layer: torch.tensor([t for s in seqs for t in s]) for layer, seqs in routing.items()}, lengths)
    return counts


def test_one_request_windows_exact_on_hand_made_routing():
    counts = _counts(HAND)
    # by hand, layer 0, m = 2: windows {0,1,2} {1,2,3,4} {0,3,4,5} | {2,3} {2,3,4,5} -> (3+4+4+2+4)/5
    assert counts.expected_distinct(2, 1)[0].item() == pytest.approx(17 / 5)
    # layer 1, m = 3: {0,1} {0,1,2,3} | {0,1,4,5} -> 10/3
    assert counts.expected_distinct(3, 1)[1].item() == pytest.approx(10 / 3)
    for m in range(1, 5):
        assert int(counts.windows[m - 1]) == sum(max(0, len(s) - m + 1) for s in HAND[0])
        for li, layer in enumerate(sorted(HAND)):
            windows = brute_force(HAND[layer], m)
            want = sum(len(w) for w in windows) / len(windows)
            assert counts.expected_distinct(m, 1)[li].item() == pytest.approx(want, abs=1e-12), (layer, m)


@pytest.mark.parametrize("concurrency", [2, 3])
def test_concurrent_windows_equal_enumeration_of_independent_draws(concurrency):
    """C windows drawn independently from the windows seen: the estimator's 1 - (1 - p)^C per
    expert equals the mean union size over every ordered C-tuple of windows."""
    counts = _counts(HAND)
    for m in (1, 2, 3):
        for li, layer in enumerate(sorted(HAND)):
            windows = brute_force(HAND[layer], m)
            tuples = list(itertools.product(windows, repeat=concurrency))
            want = sum(len(set().union(*t)) for t in tuples) / len(tuples)
            assert counts.expected_distinct(m, concurrency)[li].item() == pytest.approx(want, abs=1e-12)


def test_long_sequences_counted_in_several_passes(monkeypatch):
    from specforge_k25.target_engine import routing

    whole = _counts(HAND)
    monkeypatch.setattr(routing, "WINDOW_STARTS_PER_PASS", 2)  # window starts 0-1, 2-3 of each sequence
    assert torch.equal(_counts(HAND).hits, whole.hits)


def test_state_round_trip_and_merge(tmp_path):
    counts = _counts(HAND)
    counts.save(tmp_path)
    back = load_counts(tmp_path)
    assert torch.equal(back.hits, counts.hits) and torch.equal(back.windows, counts.windows)
    back.merge(counts)
    assert torch.allclose(back.expected_distinct(2, 4), counts.expected_distinct(2, 4))  # same data twice: same means
    assert (tmp_path / "routing.json").is_file() and load_counts(tmp_path / "none") is None


def test_bad_batch_refused():
    counts = RoutingCounts([0], 6, 2)
    with pytest.raises(ValueError, match="tokens for a batch"):
        counts.add({0: torch.zeros(3, 2, dtype=torch.long)}, [4])
    with pytest.raises(ValueError, match="no window"):
        counts.expected_distinct(2)


def test_hf_reference_router_counts_equal_brute_force(tiny_deepseek_path):
    """The tiny DeepSeek's own router (HF transformers, every MoE layer's gate) on two sequences:
    the counter's expected distinct experts == the windows enumerated by brute force."""
    import json
    from pathlib import Path

    from specforge_k25.target_engine.hf_reference import load_text_model

    layers, experts, top_k = moe_layout(json.loads(Path(tiny_deepseek_path, "config.json").read_text()))
    model = load_text_model(tiny_deepseek_path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in (19, 11)]
    ids: dict[int, list] = {layer: [] for layer in layers}
    hooks = [model.model.layers[layer].mlp.gate.register_forward_hook(
        lambda mod, args, out, layer=layer: ids[layer].append(out[2].detach().clone())) for layer in layers]
    with torch.no_grad():
        for s in seqs:
            model.model(s[None])
    for h in hooks:
        h.remove()
    counts = RoutingCounts(layers, experts, top_k, max_window=8)
    counts.add({layer: torch.cat(ids[layer]) for layer in layers}, [len(s) for s in seqs])
    for li, layer in enumerate(layers):
        per_seq = [[tuple(t.tolist()) for t in x] for x in ids[layer]]
        for m in (1, 2, 4, 8):
            windows = brute_force(per_seq, m)
            assert counts.expected_distinct(m, 1)[li].item() == pytest.approx(sum(map(len, windows)) / len(windows))
            pairs = list(itertools.product(windows, repeat=2))
            assert counts.expected_distinct(m, 2)[li].item() == pytest.approx(
                sum(len(a | b) for a, b in pairs) / len(pairs))
    assert len(layers) >= 1 and experts > top_k


def test_recorder_counts_a_batch_and_skips_one_sglang_did_not_report(capsys):
    """`finish` stitches a batch's forwards (a chunked prefill) in order; a batch with a MoE layer
    SGLang reported nothing for (a kernel that routes inside itself) is skipped and counted as such,
    the run going on. (SGLang's own calls into the recorder: tests/target_engine/test_target.py.)"""
    from specforge_k25.target_engine.routing import RoutingRecorder

    rec = object.__new__(RoutingRecorder)  # without SGLang's recorder slot: start/finish only
    rec.counts, rec._ids = RoutingCounts([0, 1], num_experts=6, top_k=2, max_window=4), None
    rec.finish([3])  # nothing recorded since no start: nothing counted
    rec.start()
    for layer, seqs in HAND.items():  # two forwards per layer, as a chunked prefill of the batch
        flat = torch.tensor([t for s in seqs for t in s])
        rec._ids.setdefault(layer, []).extend([flat[:5], flat[5:]])
    rec.finish([len(s) for s in HAND[0]])
    assert torch.equal(rec.counts.hits, _counts(HAND).hits) and rec._ids is None
    rec.start()
    rec._ids[0] = [torch.tensor([[0, 1]])]
    rec.finish([1])
    assert rec.counts.skipped_batches == 1 and rec.counts.tokens == 7
    assert "no expert choice for MoE layers [1]" in capsys.readouterr().err
