"""SGLang's KV pages: the one rule every count of KV slots follows (the memory plan's pool, the
producer's check of a batch, regeneration's groups, where a chunked prefill may cut a sequence).

SGLang 0.5.23 allocates a request's KV in whole pages of `page_size` tokens and floors its pool to
whole pages (srt/model_executor/pool_configurator.py:646 and :652); its scheduler ends a chunk of a
chunked prefill on a page boundary (srt/managers/schedule_policy.py:1665-1671). The page size is
1 for most attention backends (srt/arg_groups/overrides.py:1341-1363, `_page_size_default`) and 64
for trtllm_mla, flashmla and cutedsl_mla (overrides.py:1143-1175), the backend SGLang picks for
DeepSeek/Kimi MLA on sm100/sm103 (srt/arg_groups/model_overrides/deepseek_v2.py:179-185).
"""
from __future__ import annotations

# attention backends whose KV pool SGLang 0.5.23 pages (overrides.py:1143-1197: the MLA kernels
# take 32 or 64, SGLang sets 64 when none is given; trtllm_mha and hpc-ops likewise 64)
PAGED_BACKENDS = {"trtllm_mla": 64, "flashmla": 64, "cutedsl_mla": 64, "trtllm_mha": 64, "hpc_ops": 64}


def whole_pages(tokens: int, page_size: int = 1) -> int:
    """KV slots `tokens` of one request take: rounded up to whole pages."""
    if page_size < 1:
        raise ValueError(f"KV page size {page_size}: must be >= 1")
    return -(-tokens // page_size) * page_size


def pool_floor(tokens: int, page_size: int = 1) -> int:
    """The KV pool SGLang keeps of a `tokens` cap: floored to whole pages."""
    return tokens // page_size * page_size


def batch_slots(lengths, page_size: int = 1) -> int:
    """KV slots a batch of requests of `lengths` tokens holds at once (each in whole pages)."""
    return sum(whole_pages(n, page_size) for n in lengths)


def chunk_end(start: int, room: int, length: int, page_size: int = 1) -> int:
    """Where a prefill forward with `room` tokens left ends a sequence of `length` that it continues
    from `start` (a page boundary): the whole rest when it fits, else on the last page boundary
    within the room, as SGLang's scheduler cuts (`start` itself: nothing fits this forward)."""
    end = start + room
    return length if end >= length else end // page_size * page_size
