"""MoE routing counts read while the target prefills training batches: how many distinct experts a
verify window of m consecutive tokens of one request touches, per MoE layer (the serving cost
model's input, specforge_k25/serving; docs/PERFORMANCE.md "Will this head pay on my node?").

`RoutingCounts` keeps, per window size m = 1..max_window and per MoE layer, the number of windows
seen and, per expert, how many of them it appears in. Small (windows x layers x experts integers),
never hidden states. From them:
- one request: E[distinct experts in a window of m] = sum_e hits_e / windows (exact: the mean
  over every window of m consecutive tokens seen, windows never crossing a sequence's end);
- C requests: E[distinct in C windows] = sum_e 1 - (1 - hits_e / windows)^C, exact for C windows
  drawn independently from the windows seen (the same window may be drawn twice), which is how
  the requests of a batch are taken to relate to each other.

`RoutingRecorder` fills one from SGLang's expert-distribution recorder slot: SGLang 0.5.23 calls
`get_global_expert_distribution_recorder().on_select_experts(topk_ids)` from `select_experts`
(srt/layers/moe/topk.py ~3138) inside `with_current_layer(i)` (srt/models/deepseek_v2.py ~3181);
the recorder is replaced through `set_global_expert_distribution_recorder`
(srt/eplb/expert_distribution.py ~383), not patched. It only reads the ids: the forward is unchanged.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROUTING_FILE = "routing.pt"  # in the run folder: the counts (torch.save of RoutingCounts.state())
ROUTING_SUMMARY = "routing.json"  # beside it: the expected distinct experts the serving model reads
WINDOW_STARTS_PER_PASS = 1024  # Kimi (384 experts, windows up to 16): ~25 MB of temporaries per pass


class RoutingCounts:
    """Window counts of one target's MoE routing (see the module's docstring)."""

    def __init__(self, layers: list[int], num_experts: int, top_k: int, max_window: int = 16):
        if max_window < 1 or num_experts < 1 or top_k < 1:
            raise ValueError(f"routing counts: max_window {max_window}, experts {num_experts}, top_k {top_k} must be >= 1")
        self.layers, self.num_experts, self.top_k, self.max_window = list(layers), num_experts, top_k, max_window
        self.windows = torch.zeros(max_window, dtype=torch.int64)  # [m-1]: windows of m tokens seen
        self.hits = torch.zeros(max_window, len(self.layers), num_experts, dtype=torch.int64)  # [m-1, layer, expert]
        self.tokens = 0
        self.seconds = 0.0  # spent counting and copying ids in the target process (what the capture costs)
        self.skipped_batches = 0  # batches whose routing SGLang did not report (not counted)

    def add(self, topk_ids: dict[int, torch.Tensor], lengths: list[int]) -> None:
        """One batch: `topk_ids[layer]` [sum(lengths), top_k] expert ids of its tokens in order,
        `lengths` the sequences they are cut into (a window never spans two sequences)."""
        t0 = time.perf_counter()
        total = sum(lengths)
        hits = None  # on the ids' device, copied to the host once per batch
        for li, layer in enumerate(self.layers):
            ids = topk_ids[layer]
            if ids.shape[0] != total:
                raise ValueError(f"routing of layer {layer}: {ids.shape[0]} tokens for a batch of {total}")
            if hits is None:
                hits = torch.zeros_like(self.hits, device=ids.device)
            onehot = torch.zeros(total, self.num_experts, dtype=torch.int32, device=ids.device)
            onehot.scatter_(1, ids.long(), 1)  # top-k ids of a token are distinct
            start = 0
            for n in lengths:
                cum = torch.zeros(n + 1, self.num_experts, dtype=torch.int32, device=ids.device)
                torch.cumsum(onehot[start:start + n], 0, out=cum[1:])
                w = min(n, self.max_window)
                for s0 in range(0, n, WINDOW_STARTS_PER_PASS):  # bounds the [w, starts, E] temporary
                    first = torch.arange(s0, min(n, s0 + WINDOW_STARTS_PER_PASS), device=ids.device)
                    end = first[None, :] + torch.arange(1, w + 1, device=ids.device)[:, None]  # window [s, s+m)
                    present = (cum[end.clamp(max=n)] - cum[first][None]) > 0  # [w, starts, E]: expert e in it
                    hits[:w, li] += (present & (end <= n)[..., None]).sum(1)  # windows running past the end: none
                start += n
        if hits is not None:
            self.hits += hits.cpu()
        self.seconds += time.perf_counter() - t0
        for n in lengths:
            for m in range(1, min(n, self.max_window) + 1):
                self.windows[m - 1] += n - m + 1
        self.tokens += total

    def expected_distinct(self, m: int, concurrency: int = 1) -> torch.Tensor:
        """[layers] E[distinct experts] in `concurrency` independent windows of m tokens (float64)."""
        if not 1 <= m <= self.max_window:
            raise ValueError(f"window of {m} tokens: counted 1..{self.max_window}")
        w = int(self.windows[m - 1])
        if w == 0:
            raise ValueError(f"no window of {m} tokens seen (sequences shorter than {m})")
        p = self.hits[m - 1].double() / w
        return (1 - (1 - p) ** concurrency).sum(-1)

    def state(self) -> dict:
        return {"layers": self.layers, "num_experts": self.num_experts, "top_k": self.top_k,
                "max_window": self.max_window, "windows": self.windows, "hits": self.hits, "tokens": self.tokens,
                "seconds": self.seconds, "skipped_batches": self.skipped_batches}

    @classmethod
    def from_state(cls, state: dict) -> "RoutingCounts":
        out = cls(state["layers"], state["num_experts"], state["top_k"], state["max_window"])
        out.windows, out.hits, out.tokens = state["windows"].clone(), state["hits"].clone(), int(state["tokens"])
        out.seconds = float(state.get("seconds", 0.0))
        out.skipped_batches = int(state.get("skipped_batches", 0))
        return out

    def merge(self, other: "RoutingCounts") -> None:
        """Add another rank's or replica's counts of the same target."""
        if (other.layers, other.num_experts, other.max_window) != (self.layers, self.num_experts, self.max_window):
            raise ValueError("routing counts of different targets or windows cannot be merged")
        self.windows += other.windows
        self.hits += other.hits
        self.tokens += other.tokens

    def summary(self, concurrencies=(1, 8, 64, 256)) -> dict:
        """What the run folder, wandb and the run summary keep: per window size and concurrency, the
        expected distinct experts of a MoE layer (the mean over the layers)."""
        out = {"tokens": self.tokens, "capture_s": round(self.seconds, 3), "skipped_batches": self.skipped_batches,
               "moe_layers": len(self.layers),
               "num_experts": self.num_experts,
               "top_k": self.top_k, "distinct_per_layer": {}}
        for m in range(1, self.max_window + 1):
            if int(self.windows[m - 1]) == 0:
                continue
            out["distinct_per_layer"][str(m)] = {
                str(c): round(float(self.expected_distinct(m, c).mean()), 4) for c in concurrencies}
        return out

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        torch.save(self.state(), folder / ROUTING_FILE)
        (folder / ROUTING_SUMMARY).write_text(json.dumps(self.summary(), indent=1))


def load_counts(folder: str | Path) -> RoutingCounts | None:
    """The counts a run folder holds; None when it has none (a dense target, or capture off)."""
    path = Path(folder) / ROUTING_FILE
    if not path.is_file():
        return None
    return RoutingCounts.from_state(torch.load(path, weights_only=True))


def moe_layout(config: dict) -> tuple[list[int], int, int] | None:
    """(MoE layer indices, routed experts, top-k) of an HF config (its text_config for Kimi-K2.5);
    None for a dense target: nothing to record."""
    text = config.get("text_config", config)
    experts = int(text.get("n_routed_experts") or 0)
    if not experts:
        return None
    first, freq = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
    layers = [i for i in range(first, int(text["num_hidden_layers"])) if i % freq == 0]
    return layers, experts, int(text["num_experts_per_tok"])


class RoutingRecorder:
    """Fills `counts` from SGLang's select_experts calls of the forwards between `start()` and `finish()`.

    Installed in SGLang's expert-distribution recorder slot; outside them (decode steps of the
    regeneration, warm-up) it records nothing. Every id tensor is copied as handed over (.clone()),
    never written to."""

    def __init__(self, counts: RoutingCounts):
        from sglang.srt.eplb.expert_distribution import ExpertDistributionRecorder

        class _Slot(ExpertDistributionRecorder):  # the no-op recorder SGLang installs, plus our two calls
            def __init__(slot):
                slot.layer = None

            @contextmanager
            def with_current_layer(slot, layer_idx):
                before, slot.layer = slot.layer, layer_idx
                try:
                    yield
                finally:
                    slot.layer = before

            def on_select_experts(slot, topk_ids):
                if self._ids is not None and slot.layer is not None:
                    t0 = time.perf_counter()
                    self._ids.setdefault(slot.layer, []).append(topk_ids.detach().clone())
                    self.counts.seconds += time.perf_counter() - t0

        self.counts = counts
        self._ids: dict[int, list[torch.Tensor]] | None = None
        self.slot = _Slot()

    def install(self) -> None:
        from sglang.srt.eplb.expert_distribution import set_global_expert_distribution_recorder

        set_global_expert_distribution_recorder(self.slot)

    def start(self) -> None:
        """Record the forwards from here on: one batch, its tokens in order over the forwards (a
        chunked prefill's too). A batch that failed is dropped by the next start."""
        self._ids = {}

    def finish(self, lengths: list[int]) -> None:
        """Count the batch recorded since `start` (sequences of `lengths`) and stop recording."""
        ids, self._ids = self._ids, None
        if ids is None:
            return
        missing = [layer for layer in self.counts.layers if layer not in ids]
        if missing:  # a MoE kernel that routes inside itself (e.g. FlashInfer's trtllm bypass) reports no ids:
            self.counts.skipped_batches += 1  # the run goes on, the summary says how many batches were not counted
            if self.counts.skipped_batches == 1:
                print(f"routing capture: SGLang reported no expert choice for MoE layers {missing}; such batches "
                      f"are not counted", file=sys.stderr, flush=True)
            return
        self.counts.add({layer: torch.cat(ids[layer])[:, :self.counts.top_k] for layer in self.counts.layers}, lengths)


def recorder_for(model_path: str, max_window: int = 16) -> RoutingRecorder | None:
    """A recorder installed in this process's SGLang for the target at `model_path`; None for a
    dense target (nothing recorded, nothing installed)."""
    layout = moe_layout(json.loads((Path(model_path) / "config.json").read_text()))
    if layout is None:
        return None
    recorder = RoutingRecorder(RoutingCounts(*layout, max_window=max_window))
    recorder.install()
    return recorder
