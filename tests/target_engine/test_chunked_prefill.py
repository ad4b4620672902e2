"""Chunked prefill in the target process (hw.target_prefill_chunk): how a batch is cut into SGLang
forwards, and the setting's way to the engine. That the chunked states equal one forward's and HF's
is checked where the engine already starts (a new engine start costs ~20-40 s of CI): SmolLM2 and
the tiny DeepSeek (MLA) at TP 1 in test_target.py, the tiny DeepSeek at TP 2 in test_target_tp.py."""
from __future__ import annotations

import pytest

from specforge_k25.target_engine.sglang_engine import prefill_rounds


def _check_rounds(lengths, chunk):
    rounds = prefill_rounds(lengths, chunk)
    spans = [span for r in rounds for span in r]
    # concatenated forward after forward, the spans are the batch's tokens in order
    assert spans == sorted(spans)
    for i, n in enumerate(lengths):
        mine = [(s, e) for j, s, e in spans if j == i]
        assert mine[0][0] == 0 and mine[-1][1] == n and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    # each forward holds at most a chunk, and only the last is short of it
    sizes = [sum(e - s for _, s, e in r) for r in rounds]
    assert all(s == chunk for s in sizes[:-1]) and 0 < sizes[-1] <= chunk
    # a sequence is in a forward at most once
    assert all(len({i for i, _, _ in r}) == len(r) for r in rounds)
    return rounds


def test_prefill_rounds_cut_the_batch_in_order_within_the_chunk():
    assert prefill_rounds([41, 23], None) == [[(0, 0, 41), (1, 0, 23)]]  # off: one forward, as before
    # 16 does not divide either length: the first sequence's tail shares a forward with the second's head
    assert _check_rounds([41, 23], 16) == [[(0, 0, 16)], [(0, 16, 32)], [(0, 32, 41), (1, 0, 7)], [(1, 7, 23)]]
    assert _check_rounds([5, 3], 64) == [[(0, 0, 5), (1, 0, 3)]]
    for lengths in ([1], [7, 1, 30, 2], [32, 32], [100]):
        for chunk in (1, 3, 16, 32, 33):
            _check_rounds(lengths, chunk)
    with pytest.raises(ValueError, match="prefill chunk of 0 tokens"):
        prefill_rounds([4], 0)


def test_prefill_chunk_reaches_the_engine_from_the_config(smollm2_path):
    """hw.target_prefill_chunk -> the run's TargetSpec (every TP rank builds its engine from it); on cpu off by
    default, on cuda SGLang's chunked_prefill_size for the GPU (plan/engine.py)."""
    from specforge_k25.config import compose_job
    from specforge_k25.setup.target import target_spec

    assert target_spec(compose_job([])).prefill_chunk is None
    assert target_spec(compose_job(["hw.target_prefill_chunk=8192"])).prefill_chunk == 8192


def test_prefill_rounds_cut_on_kv_page_boundaries():
    """64-token pages (trtllm_mla on B300): a sequence cut by a forward's budget ends on a page
    boundary, as SGLang's scheduler cuts (schedule_policy.py:1665-1671); the room below a page goes
    unused; a sequence that ends inside the budget is not cut. B300's 16384-token chunk over a
    replica's 4 x 5000 tokens: the 4th sequence's first 1344 tokens (21 pages) fit, not 1384."""
    rounds = prefill_rounds([5000] * 4, 16384, 64)
    assert rounds == [[(0, 0, 5000), (1, 0, 5000), (2, 0, 5000), (3, 0, 1344)], [(3, 1344, 5000)]]
    for lengths, chunk in (([41, 23], 40), ([100, 7, 300], 64), ([129], 64), ([63, 64, 65], 96)):
        spans = [s for r in prefill_rounds(lengths, chunk, 32) for s in r]
        assert all(end == lengths[i] or end % 32 == 0 for i, _, end in spans)  # cuts on pages only
        for i, n in enumerate(lengths):  # every token once, in order
            mine = [(s, e) for j, s, e in spans if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == n and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert all(sum(e - s for _, s, e in r) <= chunk for r in prefill_rounds(lengths, chunk, 32))
    assert prefill_rounds([41, 23], 16, 1) == prefill_rounds([41, 23], 16)  # unpaged: as before
    with pytest.raises(ValueError, match="at least one KV page"):
        prefill_rounds([4], 32, 64)
