"""DFlash through the trainer's interface (draft/method.py hooks): the learner builds no teacher,
counts block positions, attaches the target's lm_head and draws anchors from its generator, seeded
per batch; setup refuses data that holds the mask token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specforge_k25.data.dataset import TokenizedData
from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.dflash.config import DFlashSpec
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.draft.registry import get_method, method_of
from specforge_k25.setup.data_checks import check_reserved_tokens
from specforge_k25.train.learner import DraftLearner, batch_seed

CFG = DFlashConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, vocab_size=40, target_hidden_size=16, num_aux_hidden_states=2,
                   block_size=4, mask_token_id=39, num_anchors=2)


def _learner() -> DraftLearner:
    torch.manual_seed(0)
    draft = DFlashDraft(CFG)
    opt = torch.optim.SGD(draft.trainable_parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return DraftLearner(method_of(draft), draft, torch.randn(40, 16), opt, sched, spec=DFlashSpec(block_size=4),
                        grad_accum=1, grad_clip=1e9, teacher_chunk=64, autocast_bf16=False)


def test_the_learner_trains_dflash_without_a_teacher(one_torch_thread):
    learner = _learner()
    assert learner.depth == CFG.block_size - 1
    assert learner.draft.lm_head_weight.data_ptr() == learner.lm_head.data_ptr()  # attached, not copied
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(0, 39, (n,), generator=g), torch.ones(n, dtype=torch.bool)) for n in (12, 9)]
    stream = (samples, [12, 9], torch.randn(21, 2 * 16, generator=g), torch.randn(21, 16, generator=g))
    seeds = lambda item: [batch_seed(0, "train", item, s) for s in (0, 1)]  # noqa: E731
    batch = learner.make_batch(*stream, seeds=seeds(3))
    assert batch.teacher is None and batch.draws[0].shape == (2, 2)
    again = learner.make_batch(*stream, seeds=seeds(3))
    other = learner.make_batch(*stream, seeds=seeds(4))
    assert torch.equal(batch.draws[0], again.draws[0]) and not torch.equal(batch.draws[0], other.draws[0])
    # a sequence draws the same alone as in the batch (what any co-located split relies on)
    alone = learner.make_batch([samples[1]], [9], stream[2][12:], stream[3][12:], seeds=seeds(3)[1:])
    assert torch.equal(alone.draws[0][0][alone.draws[1][0]], batch.draws[0][1][batch.draws[1][1]])
    res = learner.train_micro(batch)
    assert res.counted.shape == (3,) and torch.equal(res.counted, learner.method.loss_positions(batch, 3))
    assert learner.draft.fc.weight.grad is not None
    empty = learner.empty_batch()  # a sharded rank without a share: anchors that count nothing
    assert empty.teacher is None and not empty.draws[1].any()


def test_setup_refuses_data_holding_the_mask_token():
    data = TokenizedData([Sample(torch.tensor([1, 5, 9]), torch.ones(3, dtype=torch.bool))],
                         [Sample(torch.tensor([3, 39, 7]), torch.ones(3, dtype=torch.bool))])
    special = SimpleNamespace(special=True)
    tokenizer = SimpleNamespace(added_tokens_decoder={0: special, 6: special, 7: special}, bos_token_id=1,
                                eos_token_id=2, pad_token_id=None, convert_ids_to_tokens=lambda t: f"<t{t}>")
    with pytest.raises(ValueError, match=r"reserves token id\(s\) \[39\].*39 \('<t39>', first in the held-out sample 0\)"
                                         r".*draft.mask_token_id=6"):
        check_reserved_tokens(get_method("dflash"), CFG, data, tokenizer, regenerate=False)
    check_reserved_tokens(get_method("dflash"), CFG, TokenizedData(data.train, []), tokenizer, regenerate=False)
    check_reserved_tokens(get_method("eagle3"), None, data, tokenizer, regenerate=False)  # reserves nothing


def test_an_unset_mask_token_is_the_highest_special_token_the_data_never_holds():
    from specforge_k25.draft.eagle3.config import Eagle3Spec
    from specforge_k25.setup.data_checks import unused_special_ids
    data = TokenizedData([Sample(torch.tensor([1, 5, 9, 6]), torch.ones(4, dtype=torch.bool))], [])
    special = SimpleNamespace(special=True)
    tokenizer = SimpleNamespace(added_tokens_decoder={0: special, 2: special, 3: special, 4: special, 6: special,
                                                      7: SimpleNamespace(special=False)},
                                bos_token_id=0, eos_token_id=2, pad_token_id=None)
    assert unused_special_ids(tokenizer, data, end_of_turn_id=4) == [3]  # 6 is in the data, 7 not special
    dflash, eagle3 = get_method("dflash"), get_method("eagle3")
    assert dflash.with_unused_special_tokens(DFlashSpec(), [3, 5]).mask_token_id == 5
    assert dflash.with_unused_special_tokens(DFlashSpec(mask_token_id=11), [3, 5]).mask_token_id == 11  # set: kept
    assert dflash.with_unused_special_tokens(DFlashSpec(), []).mask_token_id is None  # resolve_config: vocab - 1
    assert eagle3.with_unused_special_tokens(Eagle3Spec(), [3, 5]) == Eagle3Spec()
