"""Which engine a target process builds: `TargetSpec` (picklable, no weights) -> a `TargetEngine`
(target_engine/base.py), the SGLang engine or the HF reference."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CPU_MEM_FRACTION_STATIC, TargetEngine
from .sampling import Regeneration


@dataclass
class TargetSpec:
    """Everything a target process needs to build its engine (picklable, no weights)."""

    engine: str  # "sglang" | "hf" (the HF reference, for tests and comparisons)
    model_path: str
    architecture: str
    capture_points: list
    device: str = "cpu"
    dtype: str = "float32"
    tp_size: int = 1
    pp_size: int = 1  # pipeline stages (SGLang PP, target_engine/sglang_pipeline.py); world = pp_size * tp_size processes
    gpu_id: int = 0  # GPU of this node's first TP rank; the others use the next ones
    max_total_tokens: int = 16384
    mem_fraction_static: float = CPU_MEM_FRACTION_STATIC  # the run passes hw.mem_fraction_static
    attention_backend: str | None = None  # None: SGLang's choice per GPU (torch_native on CPU)
    num_threads: int = 1
    trust_remote_code: bool = False
    nnodes: int = 1  # nodes the TP group spans (each holds tp_size // nnodes consecutive ranks)
    node_rank: int = 0  # this node's index among them; node 0 holds TP rank 0 (and the trainer)
    dist_init_addr: str | None = None  # host:port of the TP group's rendezvous; required when nnodes > 1
    dist_timeout: int | None = None  # seconds the TP group's setup and collectives wait (SGLang dist_timeout)
    load_threads: int = 8  # shards SGLang's multithreaded loader reads at a time
    prefill_chunk: int | None = None  # tokens per target forward; a longer batch is prefilled in chunks (None: one forward)
    regeneration: Regeneration | None = None  # data.regenerate: answer each prompt, then prefill prompt + answer
    routing_dir: str | None = None  # MoE routing counts written here by TP rank 0 at the end (target_engine/routing.py)

    @property
    def num_aux(self) -> int:
        """K: the aux states each batch carries, one per capture point (the ring's aux is K*Ht wide)."""
        return len(self.capture_points)

    @property
    def world_size(self) -> int:
        """The target's processes: tp_size ranks in each of pp_size stages (world rank tp_size * stage + TP rank)."""
        return self.tp_size * self.pp_size

    def local_tp_ranks(self) -> list[int]:
        """The TP ranks this node runs."""
        per_node = self.tp_size // self.nnodes
        return list(range(self.node_rank * per_node, (self.node_rank + 1) * per_node))


def check_tp_layout(spec: TargetSpec) -> None:
    """Refuse a TP layout SGLang cannot form, before any process starts."""
    if spec.tp_size < 1 or spec.nnodes < 1:
        raise ValueError(f"target TP size {spec.tp_size} and nodes {spec.nnodes} must be >= 1")
    if spec.tp_size % spec.nnodes:
        raise ValueError(f"target TP size {spec.tp_size} does not split evenly over {spec.nnodes} nodes")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ValueError(f"target node rank {spec.node_rank} is out of range for {spec.nnodes} node(s)")
    if spec.nnodes > 1 and not spec.dist_init_addr:
        raise ValueError(f"a target TP group over {spec.nnodes} nodes needs the rendezvous address "
                         f"(hw.target_dist_init_addr=HOST:PORT of node 0, reachable from every node)")
    if spec.engine != "sglang" and spec.tp_size > 1:
        raise ValueError(f"target engine {spec.engine!r} runs TP 1 only (tp_size={spec.tp_size})")
    if spec.pp_size < 1:
        raise ValueError(f"target pipeline stages {spec.pp_size}: must be >= 1")
    if spec.pp_size > 1:
        if spec.engine != "sglang":
            raise ValueError(f"target engine {spec.engine!r} has no pipeline stages (pp_size={spec.pp_size}): "
                             f"pipeline parallelism needs the sglang engine")
        if spec.nnodes > 1:
            raise ValueError(f"a pipeline-parallel target (pp_size={spec.pp_size}) runs on one node; "
                             f"{spec.nnodes} nodes are not supported yet")
        from .hf_config import read_target_info

        num_layers = read_target_info(spec.model_path).num_layers
        if spec.pp_size > num_layers:
            raise ValueError(f"target pipeline of {spec.pp_size} stages but the target has {num_layers} layers: "
                             f"every stage needs at least one layer")


def build_target(spec: TargetSpec, tp_rank: int = 0, pp_rank: int = 0) -> TargetEngine:
    """TP rank `tp_rank` (of pipeline stage `pp_rank`) of the target `spec` describes, in this process."""
    if spec.engine == "sglang" and spec.pp_size > 1:
        from .sglang_pipeline import SGLangPipelineStage

        return SGLangPipelineStage(
            spec.model_path, spec.architecture, spec.capture_points, pp_size=spec.pp_size, pp_rank=pp_rank,
            device=spec.device, dtype=spec.dtype, tp_size=spec.tp_size, tp_rank=tp_rank,
            gpu_id=spec.gpu_id + spec.tp_size * pp_rank + tp_rank,  # one node: the world rank's GPU (CPU: thread group)
            max_total_tokens=spec.max_total_tokens, mem_fraction_static=spec.mem_fraction_static,
            attention_backend=spec.attention_backend, num_threads=spec.num_threads, trust_remote_code=spec.trust_remote_code,
            dist_timeout=spec.dist_timeout, load_threads=spec.load_threads, prefill_chunk=spec.prefill_chunk,
        )
    if spec.engine == "sglang":
        from .sglang_engine import SGLangTarget

        local_index = tp_rank - spec.local_tp_ranks()[0]  # CPU: SGLang's NUMA/thread-group index
        return SGLangTarget(
            spec.model_path, spec.architecture, spec.capture_points, device=spec.device, dtype=spec.dtype,
            tp_size=spec.tp_size, tp_rank=tp_rank, gpu_id=spec.gpu_id + local_index,
            max_total_tokens=spec.max_total_tokens, mem_fraction_static=spec.mem_fraction_static,
            attention_backend=spec.attention_backend, num_threads=spec.num_threads, trust_remote_code=spec.trust_remote_code,
            nnodes=spec.nnodes, node_rank=spec.node_rank, dist_init_addr=spec.dist_init_addr,
            dist_timeout=spec.dist_timeout, load_threads=spec.load_threads, prefill_chunk=spec.prefill_chunk,
            routing_dir=spec.routing_dir if tp_rank == 0 else None,
        )
    if spec.engine == "hf":
        from .hf_reference import HFTarget

        return HFTarget(spec.model_path, spec.capture_points, getattr(torch, spec.dtype))
    raise ValueError(f"target engine {spec.engine!r}: expected sglang or hf")
