"""The frozen embedding kept in host memory (train/host_embedding.py): the same rows as the
device table, a table that moving or casting the model does not touch, and rows that reach the
draft's device: EAGLE-3's and DFlash's forward on a fake accelerator."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from specforge_k25.draft.dflash import model as dflash_model
from specforge_k25.draft.dflash.block_attention import make_tiling
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.train.host_embedding import HostEmbedding, keep_embedding_on_host


def test_lookup_equals_the_embedding_and_the_table_stays_on_the_host():
    torch.manual_seed(0)
    table = torch.nn.Embedding(50, 8).to(torch.bfloat16)
    model = torch.nn.Module()
    model.embed_tokens = table
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    expected = table(ids)
    keep_embedding_on_host(model)
    assert isinstance(model.embed_tokens, HostEmbedding) and not model.embed_tokens.weight.requires_grad
    model.to(torch.float64)  # a cast of the whole model (as draft.to(dtype)) leaves the table as it is
    model.to("meta")  # a device move (as draft.to(cuda)) leaves it on the host
    assert model.embed_tokens.weight.device.type == "cpu" and model.embed_tokens.weight.dtype == torch.bfloat16
    got = model.embed_tokens(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert list(model.state_dict()) == ["embed_tokens.weight"]  # checkpoints leave it out by name, as before


# ------------------------------------------------- the drafts' forward on a (fake) accelerator
class _GuardOfTheFakeAccelerator(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _ModuleOfTheFakeAccelerator:
    """What autocast asks of a device's module (block attention opens an autocast context)."""

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


_GUARD = _GuardOfTheFakeAccelerator()


@pytest.fixture(scope="module")
def accelerator() -> torch.device:
    """A device for FakeTensorMode that is not the host: PrivateUse1 with a device guard and a device
    module. Fake `cuda` tensors would do, but a CPU build of torch has no device guard for cuda, which
    indexing a tensor sets (THPVariable_getitem): 'PyTorch is not linked with support for cuda devices'.
    Registered once per process; no other test uses PrivateUse1."""
    torch._C._acc.register_python_privateuseone_device_guard(_GUARD)  # False when already registered
    if not hasattr(torch, "privateuseone"):
        torch._register_device_module("privateuseone", _ModuleOfTheFakeAccelerator())
    return torch.device("privateuseone", 0)


def _eagle3_forward(device: torch.device) -> torch.Tensor:
    """Two TTT steps of a tiny EAGLE-3 draft (draft/eagle3/model.py `step`: the embedding rows meet
    the hidden states) -> the draft-vocab logits of the second."""
    cfg = DraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=16)
    with device:
        draft = Eagle3Draft(cfg)
    keep_embedding_on_host(draft)
    assert draft.embed_tokens.weight.device.type == "cpu"
    B, T = 2, 5
    ids = torch.zeros(B, T, dtype=torch.int64, device=device)
    positions = torch.arange(T, device=device).expand(B, T)
    hidden = draft.project(torch.empty(B, T, 3 * cfg.target_hidden_size, device=device))
    past = []
    for _ in range(2):
        hidden, kv = draft.step(ids, hidden, positions, past)
        past.append(kv)
    return draft.logits(hidden)


DFLASH = DFlashConfig(vocab_size=37, hidden_size=8, target_hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, intermediate_size=24, num_aux_hidden_states=2, block_size=3,
                     mask_token_id=36, num_anchors=2)


def _dflash_forward(device: torch.device) -> torch.Tensor:
    """A tiny DFlash draft over two blocks of 3 (draft/dflash/model.py `forward`: the block tokens'
    embedding rows go through the layers) -> the final-normed hidden."""
    cfg = DFLASH
    with device:
        draft = DFlashDraft(cfg)
    keep_embedding_on_host(draft)
    assert draft.embed_tokens.weight.device.type == "cpu"
    B, T, Q = 2, 6, 6
    return draft(torch.empty(B, T, 2 * cfg.target_hidden_size, device=device),
                 torch.arange(T, device=device).expand(B, T), torch.zeros(B, Q, dtype=torch.int64, device=device),
                 torch.arange(Q, device=device).expand(B, Q), torch.ones(B, 2, dtype=torch.int64, device=device))


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_drafts_forward_with_the_host_table_runs_on_the_device(accelerator, monkeypatch, method):
    """The draft on an accelerator (fake tensors: shapes and devices, no data) with its table on the
    host: the forward runs, every op's inputs on one device, which fails if the looked-up rows stay
    on the host."""
    # DFlash's tiling reads the prefix's values on the host, which fake tensors do not have: a real one's
    tiling = make_tiling(torch.tensor([[1, 2], [3, 5]]), DFLASH.block_size, DFLASH.attention_tile_rows,
                         DFLASH.attention_tile_keys)
    monkeypatch.setattr(dflash_model, "make_tiling", lambda *args: tiling)
    with FakeTensorMode():
        out = _eagle3_forward(accelerator) if method == "eagle3" else _dflash_forward(accelerator)
    assert out.device == accelerator
