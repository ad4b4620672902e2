"""A DFlash head exported by us, served by SGLang 0.5.23's DFLASH speculative decoding on CPU
(sglang_cpu_compat workaround 7), against our replay of its blocks (draft/dflash/replay.py's
`block_proposals`, as the method's `proposals` calls it) and against HF transformers' greedy decoding.

The head is built to have something to accept: one layer behind SmolLM2 (capture points
[2, 15, 27]), random q/k/v, no MLP, and an o_proj fitted by ridge regression so that at every
root r of the HF greedy outputs block position j lands on the embedding of x[r+j]: it memorises
these outputs (AL ~3 of a possible 4 at block 4), through attention over the context's target
states and the block, so a block that attends differently or reads other layers proposes
otherwise. Our replay with a causal block or the states one layer off must then disagree with
SGLang (checked here, no engine needed). SGLang serving an export whose layer ids are off by one
(dflash_config.target_layer_ids + 1, planted once by hand) gave verify steps [17, 19, 14, 18]
against the replay's [7, 5, 6, 9]. Measured: HF greedy + fit ~15 s, the DFLASH engine 50-80 s on
a busy 2-core box.
"""
from __future__ import annotations

import time

import pytest
import torch

from specforge_k25.draft.dflash.method import DFlashMethod
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.eval.acceptance import draft_proposer, replay
from specforge_k25.export.serving import export_draft, load_exported_draft
from specforge_k25.target_engine.sglang_spec import generate

POINTS = [2, 15, 27]  # capture points = inputs of these SmolLM2 layers (SGLang DFlash ids 1, 14, 26)
TEXTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
NEW_TOKENS = 20
BLOCK = 4
METHOD = DFlashMethod()
SERVING = METHOD.servings([[BLOCK - 1, 1, BLOCK]])  # [block 4], as eval/run.py asks the method


def _fitted_head(target: str, prompts, sequences, hidden, out_dir, ridge: float = 1e-2):
    from specforge_k25.target_engine.hf_config import load_embedding_and_head

    embed, lm_head = (t.float() for t in load_embedding_and_head(target))
    V, H = embed.shape
    cfg = DFlashConfig(hidden_size=H, intermediate_size=8, num_hidden_layers=1, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=V, target_hidden_size=H,
                       num_aux_hidden_states=len(POINTS), block_size=BLOCK, mask_token_id=V - 1,
                       rope_theta=100000.0, max_position_embeddings=8192)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.layers[0].mlp.down_proj.weight.zero_()  # the block's hidden = its embedding + o_proj(attention)
    draft.attach_lm_head(lm_head)
    unit = torch.nn.functional.normalize(embed, dim=-1)
    attention, residual = [], []  # o_proj's input and what o_proj must add, per drafted position
    hook = draft.layers[0].self_attn.o_proj.register_forward_hook(lambda m, i, o: attention.append(i[0][0]))
    rows = []
    for prompt, seq, aux in zip(prompts, sequences, hidden):
        attention.clear()
        METHOD.proposals(draft, _aux(aux, POINTS), seq, SERVING)  # one chunk: every root's block
        per_root = attention[0].view(len(seq) - 1, BLOCK, -1)  # roots 1..T-1
        for r in range(len(prompt), len(seq) - 1):
            for j in range(1, min(BLOCK, len(seq) - r)):
                rows.append(per_root[r - 1, j])
                residual.append(30 * unit[seq[r + j]] - embed[cfg.mask_token_id])
    hook.remove()
    a, y = torch.stack(rows).double(), torch.stack(residual).double()
    w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=torch.float64), a.T @ y).T
    with torch.no_grad():
        draft.layers[0].self_attn.o_proj.weight.copy_(w.float())
    return export_draft(draft, out_dir, [p - 1 for p in POINTS], bos_token_id=1, eos_token_id=2,
                        capture_points=POINTS), embed, lm_head


def _aux(hidden_states: list[torch.Tensor], points: list[int]) -> torch.Tensor:
    """[T, K*H]: the captured states (input of layer p = HF hidden_states[p])."""
    return torch.cat([hidden_states[p] for p in points], -1)


@pytest.fixture(scope="module")
def dflash_run(smollm2_path, tmp_path_factory, one_torch_thread):
    from transformers import AutoTokenizer

    from specforge_k25.target_engine.hf_reference import load_text_model

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    model = load_text_model(smollm2_path)
    sequences, hidden = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))[0]
            sequences.append(ids)
            hidden.append([h[0] for h in model.model(ids[None], output_hidden_states=True).hidden_states])
    export, embed, lm_head = _fitted_head(smollm2_path, prompts, sequences, hidden,
                                          tmp_path_factory.mktemp("dflash") / "head")
    t1 = time.perf_counter()
    spec = generate(smollm2_path, prompts, max_new_tokens=NEW_TOKENS, draft_path=str(export),
                    draft_args=SERVING[0].sglang_args, num_threads=1, timeout_s=600)
    print(f"HF greedy + fit {t1 - t0:.1f} s, SGLang DFLASH engine {time.perf_counter() - t1:.1f} s")
    draft = load_exported_draft(export, embed, lm_head).eval()  # as eval/run.py loads a head
    return prompts, sequences, hidden, spec, draft


def _replayed_steps(draft, prompts, sequences, hidden, points=POINTS) -> list[int]:
    return [replay(seq.tolist(), len(p), draft_proposer(METHOD.proposals(draft, _aux(h, points), seq, SERVING)[0]))[1]
            for p, seq, h in zip(prompts, sequences, hidden)]


@pytest.mark.engine
def test_sglang_dflash_equals_replay_and_greedy(dflash_run):
    prompts, sequences, hidden, spec, draft = dflash_run
    # speculation never changes greedy output (HF's, an independent implementation)
    assert spec.outputs == [seq[len(p):].tolist() for p, seq in zip(prompts, sequences)]
    ours = _replayed_steps(draft, prompts, sequences, hidden)
    assert spec.verify_steps == ours, (spec.verify_steps, ours)  # prompt by prompt
    al = sum(spec.completion_tokens) / sum(spec.verify_steps)
    print(f"SGLang DFLASH block {BLOCK}: AL {al:.3f}, verify steps {spec.verify_steps}")
    assert al > 2.0, al  # the head's drafts are accepted: the comparison above is not vacuous


@pytest.mark.engine
def test_replay_with_planted_bugs_disagrees(dflash_run):
    """Our replay with each block seeing its root's own state too (one context token early), or
    reading the states one layer later, no longer matches SGLang."""
    prompts, sequences, hidden, spec, draft = dflash_run
    assert _replayed_steps(draft, prompts, sequences, hidden, [p + 1 for p in POINTS]) != spec.verify_steps
    forward = draft.forward

    def one_more_context_token(aux, ctx_positions, block_ids, block_positions, prefix, checkpoint=False):
        return forward(aux, ctx_positions, block_ids, block_positions, prefix + 1, checkpoint)

    draft.forward = one_more_context_token
    try:
        assert _replayed_steps(draft, prompts, sequences, hidden) != spec.verify_steps
    finally:
        del draft.forward
