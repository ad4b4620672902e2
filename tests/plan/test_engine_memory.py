"""The engine's side of the memory plan as SGLang 0.5.23 counts it (plan/engine.py,
target_engine/pages.py): activations that grow with the tokens of one extend, a default chunk that
is SGLang's own chunked_prefill_size for the GPU, KV pages (64 tokens with trtllm_mla on B300) in the
pool, the producer's check and the prefill's cuts, and the trainer's NCCL buffers.

Hand numbers: Kimi-K2.5 in bf16 at TP4 (B300), one extend's activations per token =
residual stream 2 x 7168 x 2 = 28,672 B + MLA attention at 16 heads,
(1536 + 16 x 192 + 576 + 16 x 256 + 16 x 192 + 16 x 128 + 16 x 128 + 7168) x 2 = 47,232 B
(larger than the MoE's 43,584 B): 75,904 B."""
from __future__ import annotations

import math

import pytest

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, GiB, MiB, plan_memory
from specforge_k25.plan.budget import ENGINE_ACTIVATIONS, kv_pool_tokens
from specforge_k25.plan.engine import kv_page_size, prefill_chunk, sglang_chunked_prefill_size
from specforge_k25.stream.target_process import pool_advice
from specforge_k25.target_engine.pages import batch_slots, pool_floor, whole_pages

# the README's B300 DFlash command (conf/hw/b300x8.yaml: two TP4 replicas, co-located)
B300_DFLASH = ["+hw=b300x8", "target=kimi_k25", "draft=kimi_dflash", "target.aux_layers=[2,13,25,36,48,59]",
               "data.max_length=65536", "hw.mem_fraction_static=0.66", "data.regenerate=true"]
TP4_PER_TOKEN = 28_672 + (1536 + 16 * 192 + 576 + 16 * 256 + 16 * 192 + 16 * 128 + 16 * 128 + 7168) * 2


def test_engine_activations_grow_with_the_tokens_of_one_extend():
    """chunk 8192 vs 65536 on the B300 DFlash command (262,144-token target batches): the item grows by
    the 57,344 more tokens x 75,904 B (4.05 GiB), the residual stream alone by 1.53 GiB; the default
    (SGLang's 16384 on a 275,040 MiB GPU) sits between."""
    items = {}
    for chunk in (8192, 65536, None):
        extra = [f"hw.target_prefill_chunk={chunk}"] if chunk else []
        items[chunk] = plan_memory(compose_job(B300_DFLASH + extra), KIMI_K25).gpu(0).get(ENGINE_ACTIVATIONS)
    assert TP4_PER_TOKEN == 75_904
    assert items[8192] == 8192 * TP4_PER_TOKEN and items[65536] == 65536 * TP4_PER_TOKEN
    assert items[65536] - items[8192] == (65536 - 8192) * 75_904 > (65536 - 8192) * 2 * 7168 * 2
    assert round((items[65536] - items[8192]) / GiB, 2) == 4.05
    assert items[None] == 16384 * TP4_PER_TOKEN


def test_the_default_chunk_is_sglangs_chunked_prefill_size_for_the_gpu():
    """memory_hook.py's thresholds: 8192 for the RTX PRO 6000's 97,887 MiB, 16384 for the B300's
    275,040 MiB; an explicit hw.target_prefill_chunk wins; on cpu one forward per batch (None)."""
    assert [sglang_chunked_prefill_size(m) for m in (16_000, 24_000, 81_559, 97_887, 143_771, 275_040)] == \
        [2048, 4096, 8192, 8192, 8192, 16384]
    assert prefill_chunk(compose_job(["+hw=rtxpro6000x8"]).hw) == 8192
    assert prefill_chunk(compose_job(["+hw=b300x8"]).hw) == 16384
    assert prefill_chunk(compose_job(["+hw=b300x8", "hw.target_prefill_chunk=4096"]).hw) == 4096
    assert prefill_chunk(compose_job([]).hw) is None


@pytest.mark.slow
def test_sglang_resolves_the_same_chunk(smollm2_path, monkeypatch):
    """SGLang's own ServerArgs resolution, its GPU memory query faked to each profile's nvidia-smi total
    (~8 s: SGLang's import and two resolutions)."""
    from specforge_k25.target_engine import sglang_cpu_compat

    sglang_cpu_compat.apply()
    import sglang.srt.arg_groups.memory_hook as memory_hook
    from sglang.srt.server_args import ServerArgs

    for hw in ("rtxpro6000x8", "b300x8"):
        mib = compose_job([f"+hw={hw}"]).hw.gpu_memory_mib
        monkeypatch.setattr(memory_hook, "get_device_memory_capacity", lambda device=None, m=mib: m)
        args = ServerArgs(model_path=smollm2_path, device="cpu", attention_backend="torch_native")
        args.resolve_once()
        assert args.resolved_dict()["chunked_prefill_size"] == sglang_chunked_prefill_size(mib), hw


def test_b300_plans_the_kv_pool_in_pages(capsys):
    """data.max_length=5000 on B300 (trtllm_mla, 64-token pages): each of a replica's 4 sequences takes
    79 pages (5056 tokens), so the pool is 20,224 tokens = 316 pages, not 20,000 (which SGLang would
    floor to 19,968, one sequence's page short); the plan prints the page size and the pages."""
    job = compose_job(["+hw=b300x8", "target=kimi_k25", "draft=kimi", "data.max_length=5000"])
    assert kv_page_size(job.hw, KIMI_K25) == 64
    plan = plan_memory(job, KIMI_K25)
    assert plan.kv_pool_tokens == 4 * 5056 == 20_224 and plan.kv_page_size == 64
    assert plan.gpu(0).get("KV cache pool") == 20_224 * 70_272
    assert plan.fits
    # RTX (sm120, triton MLA) and cpu: no pages
    assert kv_page_size(compose_job(["+hw=rtxpro6000x8"]).hw, KIMI_K25) == 1
    assert kv_pool_tokens(compose_job(["+hw=rtxpro6000x8"]).hw, 1, 5000) == 8 * 5000
    assert kv_page_size(compose_job(["+hw=b300x8", "hw.target_attention_backend=fa3"]).hw, KIMI_K25) == 1
    from specforge_k25.plan.__main__ import render

    render(job, plan)
    out = " ".join(capsys.readouterr().out.split())
    assert "KV pool 20224 tokens = 316 pages of 64 token(s)" in out
    assert "20224 tokens = 316 pages of 64" in out and "64 token(s) per page (trtllm_mla)" in out


def test_the_producers_check_counts_pages_and_its_advice_works():
    """The batch of 4 x 5000 tokens in 64-token pages needs 20,224 slots. A pool at its cap (the old
    token-count plan: 20,000 requested, 19,968 kept) is refused naming the cap that fits, not
    hw.mem_fraction_static (the cap, not memory, binds); a pool below its cap names the fraction."""
    need = batch_slots([5000] * 4, 64)
    assert need == 20_224 and batch_slots([5000] * 4) == 20_000
    assert pool_floor(20_000, 64) == 19_968 and whole_pages(5000, 64) == 5056
    advice = pool_advice(19_968, 20_000, need, 64)
    assert "hw.max_total_tokens=20224" in advice and "mem_fraction_static" not in advice
    assert need <= pool_floor(20_224, 64)  # the pool the plan requests now holds it
    short = pool_advice(12_800, 20_224, need, 64)  # memory-bound: SGLang's static share holds 200 pages
    assert "raise hw.mem_fraction_static" in short and "max_total_tokens=" not in short


def test_trainer_nccl_buffers_are_planned_and_the_nccl_setting_is_stated():
    """8 co-located ranks: the world communicator's 16 channels x 2 ring connections x 4 MiB on every
    GPU; one dedicated rank has no communicator; the plan says NCCL keeps its defaults in the trainer."""
    coloc = plan_memory(compose_job(["+hw=b300x8", "target=kimi_k25", "draft=kimi"]), KIMI_K25)
    assert all(g.get("NCCL buffers (trainer communicators)") == 16 * 2 * 4 * MiB for g in coloc.gpus)
    assert any("NCCL_NVLS_ENABLE=0" in n and "engine.py:1898-1915" in n for n in coloc.notes)
    one = plan_memory(compose_job(["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi",
                                   "hw.trainer_layout=dedicated", "train.optimizer_device=cpu"]), KIMI_K25)
    assert one.gpu(0).get("NCCL buffers (trainer communicators)") == 0
    assert math.isclose(coloc.gpu(0).get("NCCL buffers (trainer communicators)") / MiB, 128)
