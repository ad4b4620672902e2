"""Workaround 4, target_engine/sglang_cpu_compat/draft_backends.py (part a) and target_verify.py (part b):
torch_native for chain drafts, both behind apply()'s `spec_patches` switch and checked by one script."""
from __future__ import annotations

import pytest
from compat_subprocess import run  # this folder is on sys.path (pytest's default prepend import mode)


_SPEC_PATCHES = """
    import types, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply(spec_patches={patched})
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    # (a) the draft-decode backend factory and torch_native (as configured by --attention-backend)
    import sglang.srt.speculative.draft_utils as draft_utils
    draft_utils.attention_backends = lambda: ("torch_native", "torch_native")
    runner = types.SimpleNamespace(device="cpu", model_config=types.SimpleNamespace(hf_config=None),
                                   req_to_token_pool=None, token_to_kv_pool=None)
    factory = object.__new__(DraftBackendFactory)
    factory.draft_model_runner, factory.topk, factory.speculative_num_steps = runner, 1, 3
    factory.qsa_profile, factory.draft_attn_backend = None, None
    try:
        backend = factory.create_decode_backend()
        print("FACTORY", type(backend).__name__, len(backend.attn_backends))
    except Exception as e:
        print("FACTORY-ERROR", type(e).__name__, e)

    # (b) TARGET_VERIFY through torch_native's extend path: 2 requests, verified prefixes 5 and 3,
    # 4 chain tokens each, GQA 4 query / 2 kv heads. Reference: SDPA with the chain (= causal) mask.
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd, dtn = 4, 2, 8, 4
    prefix = torch.tensor([5, 3])
    req_to_token = torch.full((3, 16), -1, dtype=torch.int64)
    req_to_token[2, :9] = torch.arange(9)        # request 0 -> pool rows 0..8
    req_to_token[0, :7] = torch.arange(9, 16)    # request 1 -> pool rows 9..15
    k_buf, v_buf = torch.randn(16, nkv, hd, generator=g), torch.randn(16, nkv, hd, generator=g)
    class Pool:
        def set_kv_buffer(self, layer, loc, k, v):
            k_buf[loc.loc], v_buf[loc.loc] = k.view(-1, nkv, hd), v.view(-1, nkv, hd)
        def get_key_buffer(self, i): return k_buf
        def get_value_buffer(self, i): return v_buf
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                   token_to_kv_pool=Pool())
    layer = types.SimpleNamespace(qk_head_dim=hd, v_head_dim=hd, tp_q_head_num=nh, tp_k_head_num=nkv, layer_id=0,
                                  is_cross_attention=False, attn_type=AttentionType.DECODER, scaling=hd ** -0.5,
                                  sliding_window_size=None)
    out_loc = torch.cat([torch.arange(5, 9), torch.arange(12, 16)])
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([2, 0]),
                                  seq_lens=prefix.clone(), extend_prefix_lens=None, extend_seq_lens=None,
                                  encoder_lens=None, out_cache_loc=out_loc,
                                  spec_info=types.SimpleNamespace(topk=1, draft_token_num=dtn))
    q = torch.randn(2 * dtn, nh * hd, generator=g)
    k, v = torch.randn(2 * dtn, nkv * hd, generator=g), torch.randn(2 * dtn, nkv * hd, generator=g)
    backend = TorchNativeAttnBackend(runner)
    try:
        got = backend.forward_extend(q, k, v, layer, batch).view(2 * dtn, nh, hd)
    except Exception as e:
        print("VERIFY-ERROR", type(e).__name__, e)
    else:
        rows = [torch.arange(9), torch.arange(9, 16)]
        worst = 0.0
        for r, (p, kv_rows) in enumerate(zip(prefix.tolist(), rows)):
            qr = q[r * dtn:(r + 1) * dtn].view(dtn, nh, hd).transpose(0, 1)                # [nh, dtn, hd]
            kr = k_buf[kv_rows].repeat_interleave(nh // nkv, 1).transpose(0, 1)           # [nh, p+dtn, hd]
            vr = v_buf[kv_rows].repeat_interleave(nh // nkv, 1).transpose(0, 1)
            visible = torch.arange(p + dtn)[None] <= (p + torch.arange(dtn))[:, None]       # prefix + chain so far
            w = torch.softmax((qr @ kr.transpose(1, 2)) * hd ** -0.5 + torch.where(visible, 0.0, float("-inf")), -1)
            worst = max(worst, (got[r * dtn:(r + 1) * dtn] - (w @ vr).transpose(0, 1)).abs().max().item())
        print("VERIFY-DIFF", worst, "SEQ_LENS_RESTORED", torch.equal(batch.seq_lens, prefix))
"""


@pytest.mark.slow
def test_spec_patches_needed_and_working():
    without = run(_SPEC_PATCHES.format(patched=False))
    assert without.returncode == 0, without.stderr[-3000:]
    assert "FACTORY-ERROR ValueError" in without.stdout and "torch_native" in without.stdout, without.stdout
    assert "VERIFY-ERROR" in without.stdout, f"SGLang's torch_native now handles TARGET_VERIFY: {without.stdout}"
    with_ = run(_SPEC_PATCHES.format(patched=True))
    assert with_.returncode == 0, with_.stderr[-3000:]
    assert "FACTORY ChainDraftBackends 2" in with_.stdout, with_.stdout
    diff = float(with_.stdout.split("VERIFY-DIFF")[-1].split()[0])
    assert diff < 1e-5 and "SEQ_LENS_RESTORED True" in with_.stdout, with_.stdout
