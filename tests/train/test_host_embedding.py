"""The frozen embedding kept in host memory (train/host_embedding.py): the same rows as the
device table, and a table that moving or casting the model does not touch."""
from __future__ import annotations

import torch

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
