"""The trainer's batch takes the aux states as the stream carries them: K*Ht wide, K from the
capture points, and a draft whose fc takes another width is named instead of failing in a matmul."""
from __future__ import annotations

import pytest
import torch

from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.eagle3_mla.model import Eagle3MLADraft, MLADraftConfig
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.registry import method_of
from specforge_k25.train.learner import DraftLearner

V, VD, HT = 40, 16, 8


def _trainer(draft) -> DraftLearner:
    opt = torch.optim.SGD(draft.trainable_parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    method = method_of(draft)
    return DraftLearner(method, draft, torch.randn(V, HT), opt, sched, spec=method.spec_class(ttt_length=2), grad_accum=1,
                        grad_clip=1e9, teacher_chunk=64, autocast_bf16=False)


def _mla_draft(k: int) -> Eagle3MLADraft:
    """The MLA EAGLE-3 head, whose fc takes any number K of aux states."""
    return Eagle3MLADraft(MLADraftConfig(hidden_size=HT, intermediate_size=12, num_attention_heads=2, q_lora_rank=6,
                                         kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                                         vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT,
                                         num_aux_hidden_states=k))


def _stream_batch(k: int, lengths=(5, 3)):
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, V, (n,), generator=g), torch.ones(n, dtype=torch.bool)) for n in lengths]
    n = sum(lengths)
    return samples, list(lengths), torch.randn(n, k * HT, generator=g), torch.randn(n, HT, generator=g)


@pytest.mark.parametrize("k", [2, 5])
def test_a_batch_of_k_aux_states_trains_a_draft_that_takes_k(k, one_torch_thread):
    torch.manual_seed(0)
    trainer = _trainer(_mla_draft(k))
    samples, lengths, aux, final = _stream_batch(k)
    batch = trainer.make_batch(samples, lengths, aux, final)
    assert batch.aux_hidden.shape == (2, 5, k * HT)
    assert torch.equal(batch.aux_hidden[1, :3], aux[5:]) and not batch.aux_hidden[1, 3:].any()
    assert trainer.train_micro(batch) is not None
    assert trainer.draft.fc.weight.grad.shape == (HT, k * HT)
    # a rank without a share stands in with a batch of the same width (sharded layout)
    assert trainer.empty_batch().aux_hidden.shape == (1, 1, k * HT)


def test_a_stream_of_another_count_than_the_draft_takes_is_named(one_torch_thread):
    draft = Eagle3Draft(DraftConfig(hidden_size=HT, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=4, vocab_size=V, draft_vocab_size=VD, target_hidden_size=HT))
    trainer = _trainer(draft)
    assert trainer.empty_batch().aux_hidden.shape == (1, 1, 3 * HT)
    assert trainer.make_batch(*_stream_batch(3)).aux_hidden.shape[-1] == 3 * HT
    with pytest.raises(ValueError, match="the stream's aux states are 40 wide, the draft reads 24"):
        trainer.make_batch(*_stream_batch(5))
