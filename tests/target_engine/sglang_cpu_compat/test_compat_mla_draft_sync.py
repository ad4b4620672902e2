"""Workaround 6, target_engine/sglang_cpu_compat/mla_draft_sync.py: the MLA draft's embedding hand-over on CPU."""
from __future__ import annotations

import pytest
from compat_subprocess import run  # this folder is on sys.path (pytest's default prepend import mode)


_MLA_DRAFT = """
    import types, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    sglang_cpu_compat.apply()
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM as Draft
    sync, empty = torch.cuda.synchronize, torch.cuda.empty_cache
    print("CUDA", torch.cuda.is_available())
    for name in ("set_embed", "set_embed_and_head"):  # the two ways the EAGLE worker hands the target's over
        for kind, method in (("SGLANG", getattr(Draft, name).__wrapped__), ("PATCHED", getattr(Draft, name))):
            draft = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=8, target_hidden_size=None),
                                          model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(4, 8)),
                                          lm_head=torch.nn.Linear(8, 4, bias=False))
            embed, head = torch.randn(4, 8), torch.randn(4, 8)
            try:
                method(draft, *((embed,) if name == "set_embed" else (embed, head)))
            except Exception as e:
                print(kind, name, "error", type(e).__name__, str(e).splitlines()[0])
            else:
                print(kind, name, "ok", draft.model.embed_tokens.weight is embed,
                      name == "set_embed" or draft.lm_head.weight is head)
    print("RESTORED", torch.cuda.synchronize is sync and torch.cuda.empty_cache is empty)
"""


@pytest.mark.slow
def test_mla_draft_set_embed_needed_and_working():
    """Needed: SGLang's MLA draft takes over the target's embedding (and head), then calls
    torch.cuda.synchronize, which CPU torch refuses. Works: patched, both take the target's
    tensors, and torch.cuda is left as it was. (SGLang's own method is the patch's `__wrapped__`.)"""
    out = run(_MLA_DRAFT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CUDA False" in out.stdout, out.stdout
    for name in ("set_embed", "set_embed_and_head"):
        assert f"SGLANG {name} error" in out.stdout, f"SGLang's {name} now runs on CPU: drop workaround 6\n{out.stdout}"
        assert f"PATCHED {name} ok True True" in out.stdout, out.stdout
    assert "RESTORED True" in out.stdout, out.stdout
