"""Workaround 4 (ops): the `sgl_kernel.*_cpu` ops of EAGLE-3 decoding, in pure torch (SGLang
`SGLANG_VERSION`, CPU).

What SGLang lacks: on CPU, speculative decoding (used by `specforge_k25.eval` to let SGLang itself
measure the acceptance length) calls `sgl_kernel.*_cpu` ops where GPUs run Triton kernels
(kernels/ops/speculative/*.py, kernels/ops/kvcache/cache_move.py, srt/mem_cache/allocation.py), and
no CPU build of sgl_kernel exists.
What it does: pure-torch versions of the eight it calls (`SPEC_OPS`), which the CPU stand-in
(sgl_kernel_stand_in.py) carries as attributes. Signatures follow the call sites. Batch sizes are
small on CPU, so clarity beats speed here.

Checked by `test_spec_ops_equal_sglang_triton_kernels` in
tests/target_engine/sglang_cpu_compat/test_compat_spec_ops.py
(against SGLang's own Triton kernels run by the Triton interpreter).
"""
from __future__ import annotations

import ctypes

import torch

from .version import SGLANG_VERSION  # noqa: F401  (the version whose call sites these ops follow)


def _segments(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten segments [starts[i], ends[i]) into (segment id, column) pairs, segment-major."""
    lengths = (ends - starts).clamp(min=0).long()
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # packed offset of each segment
    cols = starts.long()[seg] + torch.arange(len(seg), device=starts.device) - first[seg]
    return seg, cols


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[rpi[i], start[i]:end[i]] = the i-th packed segment of out_cache_loc."""
    seg, cols = _segments(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[seg], cols] = out_cache_loc[: len(seg)].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse gather: i-th packed segment of out_cache_loc = req_to_token[rpi[i], start[i]:end[i]]."""
    seg, cols = _segments(start_offset, end_offset)
    out_cache_loc[: len(seg)] = req_to_token[req_pool_indices.long()[seg], cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps):
    """Request i's topk*num_steps draft slots, read from req_to_token after its seq_len."""
    n = topk * num_steps
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, seq_lens, seq_lens + n, out_cache_loc, pool_len)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    rows = torch.arange(len(accept_lens), device=accept_lens.device)
    bonus_tokens[:] = accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the KV slots of accepted tokens (accept_index != -1), keeping their order."""
    idx = accept_index.reshape(-1)
    kept = idx[idx != -1].long()
    accept_out_cache_loc[: len(kept)] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every KV buffer (raw address, bytes per row): rows[tgt] = rows[src], sources read first."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    n_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_rows * row_bytes)).from_address(address)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, row_bytes)
        rows[tgt] = rows[src].clone()


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling,
                                    topk, depth, draft_token_num, tree_mask_mode):
    """Builds each request's draft tree from the draft's top-k choices.

    Node 0 is the last verified token; node i >= 1 is the draft token `selected_index[b, i-1]`
    (an index into the draft's flattened top-k scores; `// topk` gives the entry of
    `parent_list` holding its parent's score index, 0 meaning the root). Outputs, in place:
    the children of a node as a linked list (`retrive_next_token`: first child,
    `retrive_next_sibling`: next one, in increasing node order), `retrive_index` (row in the
    flattened batch), each node's position (seq_len + its depth) and the tree attention mask
    (a node sees the root and its ancestors; mode 0 rows also span the verified prefix, left
    as allocated). -1 entries in the linked lists are expected to be pre-filled by the caller.
    """
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError("tree mask mode QLEN_ONLY_BITPACKING has no CPU version")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    parents = parent_list.reshape(len(seq_lens), -1).tolist() if parent_list.numel() else None
    mask, pos = tree_mask.view(-1), positions.view(-1)
    first_child, next_sibling = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    prefix = 0  # sum of earlier requests' verified lengths (full-mask layout)
    for b, seq_len in enumerate(seq_lens):
        sel = selected[b][: n - 1]

        def parent_node(node: int) -> int | None:  # node >= 1 -> parent node, None if not in tree
            parent_slot = sel[node - 1] // topk
            if parent_slot == 0:
                return 0
            parent_score_index = parents[b][parent_slot]
            return sel.index(parent_score_index) + 1 if parent_score_index in sel else None

        base = b * n
        for node in range(n - 1, 0, -1):  # prepend: children end up in increasing order
            retrive_index.view(-1)[base + node] = base + node
            parent = parent_node(node)
            if parent is not None:
                previous = int(first_child[base + parent])
                first_child[base + parent] = node
                if previous != -1:
                    next_sibling[base + node] = previous
        retrive_index.view(-1)[base] = base

        pos[base] = seq_len
        for row in range(n):
            if int(tree_mask_mode) == 0:  # rows of seq_len + n columns; the tree part after the prefix
                start = n * n * b + prefix * n + (seq_len + n) * row + seq_len
            else:  # rows of n columns
                start = n * n * b + n * row
            mask[start] = True
            mask[start + 1: start + n] = False
            node, level = row, 0
            while node != 0 and node is not None and level < depth:
                mask[start + node] = True
                level += 1
                node = parent_node(node)
            if row > 0:
                pos[base + row] = seq_len + level
        prefix += seq_len


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy verification: walk down the tree, at each level accept the child whose token
    equals the target's argmax after the last accepted node; stop when none does.

    `target_predict` and `predicts` are indexed by flattened node row (`retrive_index`);
    `accept_index[b, :k+1]` gets the rows of the root and the k accepted nodes,
    `accept_token_num[b] = k`, and `predicts[row]` the target token after each accepted row.
    """
    batch, n = candidates.shape
    levels = accept_index.shape[1]
    rows, first_child = retrive_index.tolist(), retrive_next_token.tolist()
    next_sibling, tokens = retrive_next_sibling.tolist(), candidates.tolist()
    target, out = target_predict.reshape(-1).tolist(), predicts.view(-1)
    for b in range(batch):
        last = rows[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, levels):
            child = first_child[b][node]
            while child != -1 and tokens[b][child] != target[last]:
                child = next_sibling[b][child]
            if child == -1:
                break
            out[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = rows[b][child]
            last, node = rows[b][child], child
        accept_token_num[b] = accepted
        out[last] = target[last]


SPEC_OPS = (
    assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu, assign_draft_cache_locs_contiguous_cpu,
    fill_bonus_tokens_cpu, fill_accept_out_cache_loc_cpu, copy_all_layer_kv_cache_cpu,
    build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu,
)
