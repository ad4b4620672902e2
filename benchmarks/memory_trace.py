"""What the trainer puts on its GPU before the target starts, traced at Kimi-K2.5 shapes on a CPU
machine, next to the plan's items for the same command.

SGLang sizes its KV pool from the free memory it measures when it starts (train/learner.py's
module doc); the plan charges each trainer GPU with the items the learner holds then
(plan/budget.py `_place_items`: the resident trainer items other than grads, AdamW and the CUDA
context). This script runs the trainer's own `build_learner` for each README GPU command under
torch's FakeTensorMode (shapes, dtypes and devices, no storage) on a fake `cuda` device, as rank 0
of a fake 8-rank process group (`torch.testing._internal.distributed.fake_pg`), and records every
storage an op creates on the device (`DeviceRecorder`):

- created: bytes of every device storage the build allocated, freed or not (what the CUDA caching
  allocator would have reserved without `release_cached_memory`);
- held: the learner's device tensors at the end of the build (FSDP2 shards, the target's lm_head or
  its slice, the vocab maps), by category;
- largest: the largest single device storage (a whole-draft or whole-head copy shows up here);

beside the plan's items (`planned_items`). Measured, not assumed: none of the numbers comes from
the plan's arithmetic. The step itself (FSDP2's all-gathers, activations, AdamW state) is not
traced: FSDP2's forward needs CUDA streams and events, which a CPU build of torch does not have;
the one-H200 runs measured that part (docs/PERFORMANCE.md §3).

    python benchmarks/memory_trace.py     # every README GPU command, ~3 min on 2 cores (a process each)

Fake tensors cost no memory, so the test tier (tests/benchmarks/test_memory_trace.py) traces the
same Kimi-K2.5 shapes, a few commands, in seconds.

Writes benchmarks/results/memory_trace.json and prints the table; docs/memory_trace.json is the
committed copy (docs/PERFORMANCE.md §3).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORLD = 8  # the README's GPU nodes: 8 GPUs, one trainer rank each co-located
# The README's GPU commands (README.md, "Run it" and the node commands) and the switches the
# issue names; each row: a name and its overrides.
COMMANDS = [
    ("rtx eagle3", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi"]),
    ("rtx eagle3 no-ckpt", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "train.activation_checkpointing=false"]),
    ("rtx eagle3 cp8", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.context_parallel=8"]),
    ("rtx eagle3_mla", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi_mla"]),
    ("rtx dflash offload", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi_dflash", "train.optimizer_device=cpu"]),
    ("rtx dflash", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi_dflash"]),
    ("rtx eagle3 pp8", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.target_pp=8", "hw.target_tp=1",
                        "hw.mem_fraction_static=0.87"]),
    ("rtx eagle3 dedicated", ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.trainer_layout=dedicated",
                              "train.optimizer_device=cpu"]),
    ("b300 eagle3", ["+hw=b300x8", "target=kimi_k25", "draft=kimi"]),
    ("b300 eagle3 dedicated", ["+hw=b300x8", "target=kimi_k25", "draft=kimi", "hw.trainer_layout=dedicated"]),
    ("b300 eagle3_mla", ["+hw=b300x8", "target=kimi_k25", "draft=kimi_mla"]),
    ("b300 dflash", ["+hw=b300x8", "target=kimi_k25", "draft=kimi_dflash"]),
    ("b300 dflash cp8", ["+hw=b300x8", "target=kimi_k25", "draft=kimi_dflash", "hw.context_parallel=8"]),
]


class DeviceRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an op's output creates on a `device_type` device: (op, shape, bytes), each
    storage once. DTensor outputs are skipped (their local tensors, which own the storage, are
    recorded by the ops that make them)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type, self.created, self._seen = device_type, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type == self.device_type:
                storage = t.untyped_storage()
                if storage._cdata not in self._seen:
                    self._seen.add(storage._cdata)
                    self.created.append((str(func), tuple(t.shape), storage.nbytes()))
        return out

    @property
    def largest(self) -> tuple:
        return max(self.created, key=lambda r: r[2], default=("", (), 0))


def _to_copy_to_cuda(to):
    """Tensor.to that reaches a fake cuda device on a CPU build of torch (whose Tensor.to refuses a
    cuda target before any mode sees it; aten._to_copy, which it calls, does not)."""
    def patched(self, *args, **kwargs):
        dev = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dev is not None and torch.device(dev).type == "cuda" and self.device.type != "cuda":
            return torch.ops.aten._to_copy(self, device=torch.device(dev), dtype=dtype or self.dtype)
        return to(self, *args, **kwargs)
    return patched


@contextlib.contextmanager
def fake_cuda_ranks(world: int = WORLD, rank: int = 0):
    """This process as `rank` of a fake `world`-rank process group on fake cuda devices: torch.cuda
    answers as if `world` GPUs were there, FSDP2's default mesh is a cuda one (built before fake mode:
    a mesh reads its ranks' values), every tensor made inside is a FakeTensor. Yields a
    DeviceRecorder of the cuda storages made inside."""
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_cuda_ranks needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with contextlib.ExitStack() as stack:
            for name, value in (("is_available", True), ("device_count", world), ("current_device", 0)):
                stack.enter_context(mock.patch(f"torch.cuda.{name}", return_value=value))
            stack.enter_context(mock.patch("torch.cuda.set_device"))
            stack.enter_context(mock.patch("torch.cuda.empty_cache"))
            stack.enter_context(mock.patch("torch._C._get_accelerator", return_value=torch.device("cuda")))
            mesh = init_device_mesh("cuda", (world,))
            stack.enter_context(mock.patch.object(fully_shard_module, "_init_default_mesh", lambda *a, **k: mesh))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(mock.patch.object(torch.Tensor, "to", _to_copy_to_cuda(torch.Tensor.to)))
            # pinned host memory is host memory: FSDP2's CPU offload pins its shards (no fake kernel for it)
            stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", lambda self, *a, **k: self))
            stack.enter_context(mock.patch.object(torch.Tensor, "is_pinned", lambda self, *a, **k: self.device.type == "cpu"))
            yield stack.enter_context(DeviceRecorder("cuda"))
    finally:
        dist.destroy_process_group()


def kimi_setup(job):
    """A RunSetup of the job's draft on Kimi-K2.5's facts (plan/facts.py KIMI_K25), without the
    target's folder: the embedding and lm_head are made (fake) in the target's dtype, the vocab
    maps from no data (their sizes are what counts)."""
    from specforge_k25.data.dataset import TokenizedData
    from specforge_k25.draft.registry import method_of_spec
    from specforge_k25.plan import KIMI_K25, resolve_draft
    from specforge_k25.plan.facts import num_capture_points
    from specforge_k25.setup.run import RunSetup
    from specforge_k25.target_engine.base import TargetInfo

    method = method_of_spec(job.draft)
    cfg = resolve_draft(job.draft, KIMI_K25, num_capture_points(job, KIMI_K25))
    info = TargetInfo.__new__(TargetInfo)
    info.vocab_size = cfg.vocab_size
    return RunSetup("(fake)", info, [], [], None, TokenizedData([], []), method, cfg)


def _fake_target_weights(setup, dtype):
    cfg = setup.draft_cfg
    embed = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    return embed, torch.empty(cfg.vocab_size, cfg.target_hidden_size, dtype=dtype)


def held_bytes(learner) -> dict[str, int]:
    """The learner's device tensors by category: the draft's shards (local storage, FSDP2's padding
    included) or whole weights, the target's lm_head (or slice), the draft's buffers."""
    from torch.distributed.tensor import DTensor

    from specforge_k25.train.host_embedding import HostEmbedding
    from specforge_k25.train.vocab_parallel import VocabShard

    out = {"draft weights": 0, "target lm_head": 0, "draft buffers": 0}
    host = {id(p) for m in learner.draft.modules() if isinstance(m, HostEmbedding) for p in m.parameters()}
    head = learner.lm_head.weight if isinstance(learner.lm_head, VocabShard) else learner.lm_head
    for p in learner.draft.parameters():
        t = p._local_tensor if isinstance(p, DTensor) else p  # to_local is an autograd op: no cuda on a CPU build
        if id(p) not in host and t.device.type == "cuda":
            out["draft weights"] += t.untyped_storage().nbytes()
    for name, b in learner.draft.named_buffers():
        if b.device.type == "cuda" and b.untyped_storage()._cdata != head.untyped_storage()._cdata:
            out["draft buffers"] += b.untyped_storage().nbytes()
    out["target lm_head"] = head.untyped_storage().nbytes() if head.device.type == "cuda" else 0
    return out


def planned_items(job) -> dict[str, int]:
    """The plan's trainer items on a trainer GPU before the target starts (plan/budget.py
    `_place_items`: resident, not grads nor AdamW state; the CUDA context apart), by category."""
    from specforge_k25.plan import KIMI_K25, plan_memory

    plan = plan_memory(job, KIMI_K25)
    trainer = next(b for b in plan.gpus if "trainer rank" in b.role)
    out = {"draft weights": 0, "target lm_head": 0, "draft buffers": 0}
    for i in trainer.items:
        if i.owner != "trainer" or i.phase is not None or i.name.startswith(("draft grads", "AdamW", "CUDA")):
            continue
        key = ("draft weights" if i.name.startswith("draft weights") else "target lm_head"
               if i.name.startswith("target lm_head") else "draft buffers" if i.name.startswith("vocab maps") else i.name)
        out[key] = out.get(key, 0) + i.bytes
    return out


def trace_build(overrides: list[str], rank: int = 0) -> dict:
    """One command's learner built as rank `rank` of its node: created / held / largest device
    bytes and the plan's items (module doc)."""
    from specforge_k25.config import compose_job
    from specforge_k25.train import learner as learner_module
    from specforge_k25.train.distributed import Ranks

    from specforge_k25.plan.budget import node_layout

    job = compose_job(overrides)
    setup = kimi_setup(job)
    layout = node_layout(job.hw)  # the plan's trainer ranks: one per target GPU co-located
    world = len(layout.trainer_gpus)
    ranks = Ranks(rank=rank, world=world, local_rank=rank, per_replica=world // job.hw.target_replicas,
                  colocated=layout.colocated, cp=job.hw.context_parallel)
    frozen = getattr(torch, job.hw.target_dtype)
    with fake_cuda_ranks(max(world, 1), rank) as rec, \
            mock.patch("specforge_k25.setup.run.load_embedding_and_head", lambda path: _fake_target_weights(setup, frozen)):
        learner = learner_module.build_learner(job, setup, 10, torch.device("cuda", 0), ranks)
        held = held_bytes(learner)
    op, shape, largest = rec.largest
    return {"overrides": overrides, "method": setup.method.name, "layout": job.hw.trainer_layout, "ranks": world,
            "optimizer_device": job.train.optimizer_device, "context_parallel": job.hw.context_parallel,
            "activation_checkpointing": job.train.activation_checkpointing,
            "created_bytes": sum(r[2] for r in rec.created), "held": held, "held_bytes": sum(held.values()),
            "largest_bytes": largest, "largest_shape": list(shape), "planned": planned_items(job),
            "planned_bytes": sum(planned_items(job).values())}


def untraced(row: dict) -> dict[str, int]:
    """Planned items the trace cannot see: not allocated through torch (NCCL's communicator
    buffers) or allocated only by a step (DDP gradient buckets)."""
    return {k: v for k, v in row["planned"].items() if k not in row["held"]}


def worst_disagreement(row: dict) -> tuple[str, float]:
    """The traced item where trace and plan differ most, relative to the larger of the two."""
    worst = ("", 0.0)
    for key in row["held"]:
        a, b = row["held"].get(key, 0), row["planned"].get(key, 0)
        rel = abs(a - b) / max(a, b) if max(a, b) else 0.0
        worst = max(worst, (key, rel), key=lambda w: w[1])
    return worst


def table(rows: list[dict]) -> str:
    g = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    lines = ["| command | ranks | created GiB | held GiB | planned (same items) GiB | largest GiB | "
             "largest difference | planned, not traced GiB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        key, rel = worst_disagreement(r)
        rest = untraced(r)
        lines.append(f"| {name} | {r['ranks']} | {g(r['created_bytes'])} | {g(r['held_bytes'])} | "
                     f"{g(r['planned_bytes'] - sum(rest.values()))} | {g(r['largest_bytes'])} | "
                     f"{key or '-'} {rel:.2%} | " + (", ".join(f"{k} {g(v)}" for k, v in rest.items()) or "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "memory_trace.json"))
    args = p.parse_args(argv)
    rows = []
    for name, overrides in COMMANDS:
        # every command in its own process: one fake process group (and device mesh) per process
        rows.append((name, _in_subprocess(overrides)))
        print(f"{name}: held {rows[-1][1]['held_bytes'] / 2**30:.2f} GiB, planned "
              f"{rows[-1][1]['planned_bytes'] / 2**30:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rank": 0, "rows": [dict(r, name=n) for n, r in rows]}, indent=1))
    print(table(rows))
    return 0


def _in_subprocess(overrides: list[str]) -> dict:
    import subprocess

    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(overrides)], capture_output=True,
                          text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(trace_build(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
