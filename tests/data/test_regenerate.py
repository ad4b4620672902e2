"""Which prompt the target answers and which tokens the loss covers when training on the target's
own answers (data/regenerate.py): hand-made cases."""
from __future__ import annotations

import pytest
import torch

from specforge_k25.data.regenerate import (CUT_DROPPED, CUT_KEPT, EMPTY, ENDED, NO_ROOM, regenerated_sample,
                                           regeneration_prompt)
from specforge_k25.data.tokenize import Sample

END = 9


def _sample(ids, mask):
    return Sample(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def test_prompt_is_everything_before_the_final_assistant_turn():
    # system+user (0..3), assistant 1 (4..5 masked), user 2 (6..7), assistant 2 (8..10 masked, cut)
    s = _sample(list(range(11)), [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1])
    assert regeneration_prompt(s).tolist() == list(range(8))  # earlier assistant turn kept as context
    one_turn = _sample([5, 6, 7, 8], [0, 0, 1, 1])
    assert regeneration_prompt(one_turn).tolist() == [5, 6]


@pytest.mark.parametrize("answer,cut,status,mask", [
    ([4, 5, END], "keep", ENDED, [1, 1, 1]),          # generated tokens + the end-of-turn token
    ([4, 5, 6], "keep", CUT_KEPT, [1, 1, 1]),          # cut at its budget, kept with its mask
    ([4, 5, 6], "drop", CUT_DROPPED, [0, 0, 0]),       # ... or masked out and counted
    ([END], "keep", EMPTY, [0]),                       # only the end token: nothing said
    ([], "keep", NO_ROOM, []),                         # no budget left below max_length
])
def test_loss_covers_exactly_the_generated_tokens(answer, cut, status, mask):
    prompt = [1, 2, 3]
    sample, got = regenerated_sample(torch.tensor(prompt + answer), len(prompt), (END, 0), cut)
    assert got == status
    assert sample.input_ids.tolist() == prompt + answer
    assert sample.loss_mask.tolist() == [False] * len(prompt) + [bool(m) for m in mask]
    assert sample.truncated == (status == CUT_KEPT)
