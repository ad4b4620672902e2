"""The frozen target embedding kept in host memory.

The draft methods look up the target's embedding ([V, H]: 2.19 GiB in bf16 for Kimi-K2.5) for a
few thousand ids per micro-batch (EAGLE-3: the sequence's tokens; DFlash: each block's anchor
token and its mask slots). Kept on every trainer GPU it takes as much memory as a sixth of a
co-located rank's sharded draft state; kept on the host, a lookup gathers its rows there and
copies only them to the device (B x T x H in the table's dtype, a few MB), at the cost of one
device-to-host copy of the ids (a synchronisation) per lookup. Nothing else changes: the rows
are the same values, so the results are bit-identical to a device table."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class HostEmbedding(nn.Embedding):
    """A frozen nn.Embedding whose table stays on the host: moving or casting the model that holds
    it (`.to(device)`, `.cuda()`, `.half()`) leaves the table where and as it is; the output is on
    the ids' device."""

    @classmethod
    def of(cls, embedding: nn.Embedding, dtype: torch.dtype | None = None) -> "HostEmbedding":
        table = embedding.weight.detach().to("cpu", dtype)
        host = cls(table.shape[0], table.shape[1], _weight=table, _freeze=True, device="cpu", dtype=table.dtype)
        return host

    def _apply(self, fn, recurse=True):
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H]
        return F.embedding(ids.cpu(), self.weight).to(ids.device)


def keep_embedding_on_host(draft: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """In place: the draft's frozen `embed_tokens` becomes a HostEmbedding (same table, in `dtype`,
    default its own)."""
    draft.embed_tokens = HostEmbedding.of(draft.embed_tokens, dtype)
    return draft
