"""Runs SGLang's own Triton kernels (Triton interpreter, on CPU) and our pure-torch `*_cpu`
stand-ins on the same random inputs; prints one JSON line {op: number of cases that differ}.

Run by tests/test_sglang_cpu_compat.py in a fresh process: TRITON_INTERPRET must be set before
triton is imported. Usage: TRITON_INTERPRET=1 python tests/spec_ops_vs_triton.py [n_cases]
"""
from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "needs TRITON_INTERPRET=1"

from specforge_k25.target import sglang_cpu_compat as compat  # noqa: E402

compat.apply()
import torch  # noqa: E402
from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def random_pool(g, bs):
    pool_len, n_reqs = 64, bs + 3
    req_to_token = torch.randint(0, 10_000, (n_reqs, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(n_reqs, generator=g)[:bs].to(torch.int64)
    start = torch.randint(0, 30, (bs,), generator=g)
    end = start + torch.randint(0, 20, (bs,), generator=g)
    return req_to_token, rpi, start, end, pool_len


def case_assign_req_to_token_pool(g, bs):
    req_to_token, rpi, start, end, pool_len = random_pool(g, bs)
    locs = torch.randint(0, 10_000, (int((end - start).sum()),), generator=g)
    ref, ours = req_to_token.clone(), req_to_token.clone()
    allocation.assign_req_to_token_pool[(bs,)](rpi, ref, start, end, locs, pool_len, pow2(bs))
    compat.assign_req_to_token_pool_cpu(rpi, ours, start, end, locs, pool_len)
    return torch.equal(ref, ours)


def case_assign_extend_cache_locs(g, bs):
    req_to_token, rpi, start, end, pool_len = random_pool(g, bs)
    n = int((end - start).sum())
    ref, ours = torch.full((n + 3,), -7), torch.full((n + 3,), -7)
    cache_locs.assign_extend_cache_locs[(bs,)](rpi, req_to_token, start, end, ref, pool_len, pow2(bs))
    compat.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, ours, pool_len)
    return torch.equal(ref, ours)


def case_assign_draft_cache_locs_contiguous(g, bs):
    req_to_token, rpi, seq_lens, _, pool_len = random_pool(g, bs)
    topk, steps = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
    ref, ours = torch.full((bs * topk * steps,), -7), torch.full((bs * topk * steps,), -7)
    cache_locs.assign_draft_cache_locs_contiguous[(bs,)](rpi, req_to_token, seq_lens, ref, pool_len, topk, steps)
    compat.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq_lens, ours, pool_len, topk, steps)
    return torch.equal(ref, ours)


def case_fill_bonus_tokens(g, bs):
    stride = int(torch.randint(1, 8, (1,), generator=g))
    tokens = torch.randint(0, 1000, (bs, stride), generator=g)
    lens = torch.randint(1, stride + 1, (bs,), generator=g).to(torch.int32)
    ref, ours = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    eagle.fill_bonus_tokens[(bs,)](tokens, lens, ref, stride)
    compat.fill_bonus_tokens_cpu(tokens, lens, ours, stride)
    return torch.equal(ref, ours)


def case_fill_accept_out_cache_loc(g, bs):
    width = int(torch.randint(1, 8, (1,), generator=g))
    index = torch.arange(bs * width).view(bs, width).to(torch.int32)
    index[torch.rand(bs, width, generator=g) < 0.4] = -1
    locs = torch.randint(0, 10_000, (bs * width,), generator=g)
    ref, ours = torch.full((bs * width,), -7), torch.full((bs * width,), -7)
    eagle.fill_accept_out_cache_loc[(index.numel(),)](index, locs, ref, pow2(index.numel()))
    compat.fill_accept_out_cache_loc_cpu(index, locs, ours)
    return torch.equal(ref, ours)


def case_copy_all_layer_kv_cache(g, bs):
    """The Triton kernel reads raw addresses, which the interpreter cannot: plain indexing is the reference."""
    layers = [torch.randn(40, int(torch.randint(1, 5, (1,), generator=g)) * 8, generator=g) for _ in range(3)]
    expected = [t.clone() for t in layers]
    src = torch.randperm(40, generator=g)[:bs]
    tgt = torch.randperm(40, generator=g)[:bs]
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    compat.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    return all(torch.equal(a, b) for a, b in zip(layers, expected))


def random_draft_tree(g, bs, topk, steps, n_draft):
    """parent_list / top_scores_index as SGLang's EAGLE draft loop builds them (organize_draft_results)."""
    scores, parents = [], [torch.arange(-1, topk).expand(bs, -1)]
    prob = torch.rand(bs, topk, generator=g).sort(dim=1, descending=True).values
    scores.append(prob)  # step 0: the root's topk children, score index 0..topk-1
    current = prob
    for i in range(1, steps):
        expanded = current.unsqueeze(2) * torch.rand(bs, topk, topk, generator=g)  # [bs, topk, topk]
        scores.append(expanded.flatten(1))
        best = expanded.flatten(1).topk(topk, dim=1)
        parents.append(best.indices + topk * topk * (i - 1) + topk)
        current = best.values
    flat = torch.cat(scores, dim=1)
    top = flat.topk(n_draft - 1, dim=1).indices.sort(dim=1).values
    parent_list = torch.cat(parents[:-1], dim=1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list, top


def tree_buffers(bs, n, seq_lens, mode):
    size = int(seq_lens.sum()) * n + n * n * bs if mode == 0 else n * n * bs
    return dict(tree_mask=torch.ones(size, dtype=torch.bool), positions=torch.full((bs * n,), -5),
                retrive=torch.full((3, bs, n), -1))


def case_tree(g, bs):
    topk = int(torch.randint(1, 4, (1,), generator=g))
    steps = int(torch.randint(1, 5, (1,), generator=g))
    n_draft = int(torch.randint(2, min(topk + topk * topk * (steps - 1), 9) + 2, (1,), generator=g))
    n_draft = min(n_draft, topk + topk * topk * (steps - 1) + 1)
    parent_list, top = random_draft_tree(g, bs, topk, steps, n_draft)
    seq_lens = torch.randint(1, 12, (bs,), generator=g)
    mode = int(torch.randint(0, 2, (1,), generator=g))
    ref, ours = tree_buffers(bs, n_draft, seq_lens, mode), tree_buffers(bs, n_draft, seq_lens, mode)
    for b in (ref, ours):
        fn = spec_tree.sgl_build_tree_kernel_triton if b is ref else compat.build_tree_kernel_efficient_cpu
        fn(parent_list, top, seq_lens, b["tree_mask"], b["positions"], *b["retrive"], topk, steps, n_draft, mode)
    built_same = all(torch.equal(ref[k], ours[k]) for k in ref)

    # verify on that tree: draft tokens that often agree with the target's argmax
    index, next_token, next_sibling = ref["retrive"]
    target = torch.randint(0, 4, (bs, n_draft), generator=g)
    candidates = torch.randint(0, 4, (bs, n_draft), generator=g)
    out = []
    for fn in (spec_tree.verify_tree_greedy_triton, compat.verify_tree_greedy_cpu):
        predicts = torch.full((bs * n_draft,), -3, dtype=torch.int32)
        accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        accept_num = torch.full((bs,), -1, dtype=torch.int32)
        fn(predicts, accept_index, accept_num, candidates, index, next_token, next_sibling, target)
        out.append((predicts, accept_index, accept_num))
    verified_same = all(torch.equal(a, b) for a, b in zip(*out))
    return built_same and verified_same


CASES = [case_assign_req_to_token_pool, case_assign_extend_cache_locs, case_assign_draft_cache_locs_contiguous,
         case_fill_bonus_tokens, case_fill_accept_out_cache_loc, case_copy_all_layer_kv_cache, case_tree]

if __name__ == "__main__":
    n_cases = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    g = torch.Generator().manual_seed(0)
    mismatches = {}
    for case in CASES:
        mismatches[case.__name__] = sum(not case(g, int(torch.randint(1, 5, (1,), generator=g)))
                                        for _ in range(n_cases))
    print("MISMATCHES", json.dumps(mismatches))
