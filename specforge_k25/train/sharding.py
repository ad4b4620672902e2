"""The co-located layout's draft state, sharded over all trainer ranks with PyTorch's FSDP2
(`fully_shard`): each rank keeps 1/W of the trainable weights, their gradients and AdamW's m/v,
so the optimizer runs on the GPUs beside the target (docs/PERFORMANCE.md §5), or, with
train.optimizer_device=cpu, in host memory (FSDP2's CPUOffloadPolicy: the shards, their grads and
AdamW live on the host; each all-gather copies the rank's shard up, each reduce-scatter its grad
shard down).

Units: the method's (`DraftMethod.fsdp_units`, submodule names, dotted ones included: for EAGLE-3
fc, the decoder layer, the final norm and the draft lm_head, and fc_norm when on; for DFlash fc,
hidden_norm, each `layers.i` and the norm), each sharded on its own; the frozen target embedding
is never sharded (train/host_embedding.py keeps it on the host). When they are gathered is the
method's choice (`DraftMethod.keep_units_gathered`):

- kept (EAGLE-3): the TTT loop calls each unit K times per micro-batch: they stay gathered from
  the first call to the end of backward (reshard_after_forward=False, and
  reshard_after_backward=False: FSDP2 would otherwise reshard after the backward of each call and
  gather again for the next, K-1 more all-gathers), and `reshard` frees them once the
  micro-batch's backward is done, before the optimizer changes the shards: one all-gather and one
  reduce-scatter per unit and micro-batch.
- freed (DFlash, a stack of layers each called once): a unit is resharded after its forward and
  gathered again for its backward (recomputed there with activation checkpointing), its unsharded
  grads freed at its reduce-scatter; the draft itself is the FSDP root over the units (no weights
  of its own: the frozen ones are ignored), so they share one communication context: the
  reduce-scatter buffers are reclaimed unit by unit and the next unit is prefetched in backward.
  Two all-gathers and one reduce-scatter per unit and micro-batch; the peak holds about two units
  instead of the whole draft.

tests/train/test_sharding.py counts the all-gathers of both.

More than one node (world size / torchrun's LOCAL_WORLD_SIZE > 1): HSDP, a 2-D device mesh
(`data_parallel_mesh`): each unit is sharded over its node's ranks and replicated across nodes,
so the per-micro-batch all-gathers and reduce-scatters stay on the node and only the
reduce-scattered gradient shards are all-reduced across nodes (plan/throughput.py counts it over
hw.internode_gbps).

Gradients are SUMMED over ranks (divide factor 1, sum-only collectives: gloo has no PREMUL_SUM),
because each rank's loss is already divided by the global number of loss positions
(train/distributed.py). Checkpoints and the export hold the full, unsharded state in the format
of a one-rank run.
"""
from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from torch import nn

from ..draft.method import DraftMethod
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # complete on rank 0, on the host


def nodes_of(world: int, local: int) -> int:
    """Nodes of a run of `world` ranks with `local` on each (torchrun's LOCAL_WORLD_SIZE)."""
    if local < 1 or world % local:
        raise ValueError(f"{world} ranks do not split into nodes of {local} (LOCAL_WORLD_SIZE)")
    return world // local


def data_parallel_mesh(device_type: str, world: int | None = None, local: int | None = None) -> DeviceMesh | None:
    """The mesh the draft is sharded on: None on one node (fully_shard's default, every rank);
    with several, (nodes, local) named ("replicate", "shard"): rank r is node r // local's
    (torchrun numbers a node's ranks consecutively), HSDP. A collective every rank calls."""
    world = world if world is not None else torch.distributed.get_world_size()
    local = local if local is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = nodes_of(world, local)
    if nodes == 1:
        return None
    return init_device_mesh(device_type, (nodes, local), mesh_dim_names=("replicate", "shard"))


def shard_draft(draft: nn.Module, units: list[str], bf16: bool = False, keep_gathered: bool = True,
                offload: bool = False, mesh: DeviceMesh | None = None) -> nn.Module:
    """In place: shard the draft's trainable units over the default process group, or on `mesh`
    (default `data_parallel_mesh`: HSDP across nodes).
    bf16: gather the weights in bf16 (what autocast computes with anyway), reduce in fp32;
    keep_gathered: DraftMethod.keep_units_gathered (module doc); offload: the shards, their grads
    and the optimizer on the host (train.optimizer_device=cpu)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    # pinned host shards copy to and from the GPU asynchronously; on a CPU run there is no device to pin for
    where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    if mesh is None:  # the weights' device before sharding (the offloaded shards go to the host after)
        mesh = data_parallel_mesh(next(p for p in draft.parameters() if p.requires_grad).device.type)
    covered = {n for n in trainable if any(n.startswith(unit + ".") for unit in units)}
    if covered != trainable:  # an unsharded trainable weight would get no gradient sum over ranks
        raise ValueError(f"trainable weights outside the FSDP units {units}: {sorted(trainable - covered)}")
    for name in units:
        unit = fully_shard(draft.get_submodule(name), mesh=mesh, reshard_after_forward=not keep_gathered, mp_policy=mp,
                           offload_policy=where)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        if keep_gathered:
            unit.set_reshard_after_backward(False)
    if not keep_gathered:  # the root over the units; its inputs keep their dtype (no param_dtype of its own)
        frozen = {p for p in draft.parameters() if not p.requires_grad}
        fully_shard(draft, mesh=mesh, reshard_after_forward=True, offload_policy=where, ignored_params=frozen)
    return draft


def reshard(draft: nn.Module, units: list[str]) -> None:
    """Free the gathered weights after a micro-batch's backward (the next forward gathers the
    updated shards)."""
    for name in units:
        draft.get_submodule(name).reshard()


def is_sharded(draft: nn.Module, units: list[str]) -> bool:
    return any(isinstance(_submodule(draft, name), torch.distributed.fsdp.FSDPModule) for name in units)


def _submodule(draft: nn.Module, name: str) -> nn.Module | None:
    try:
        return draft.get_submodule(name)
    except AttributeError:
        return None


def full_model_state(draft: nn.Module) -> dict:
    """The model state dict, unsharded; a collective every rank calls, complete on rank 0 only
    (the others get an empty dict)."""
    return get_model_state_dict(draft, options=_FULL)


def full_state(draft: nn.Module, optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict keyed by parameter name), as full_model_state."""
    return full_model_state(draft), get_optimizer_state_dict(draft, optimizer, options=_FULL)


def load_full_state(draft: nn.Module, optimizer, model: dict, optim: dict | None) -> None:
    """Each rank keeps its shard of a full state (every rank passes the same dicts)."""
    opts = StateDictOptions(full_state_dict=True, strict=False)  # the frozen embedding is not in checkpoints
    set_model_state_dict(draft, model, options=opts)
    if optim is not None:
        set_optimizer_state_dict(draft, optimizer, optim, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(method: DraftMethod, draft: nn.Module, model: dict, lm_head: torch.Tensor | None = None) -> nn.Module:
    """A plain (unsharded, host) draft holding the full state `model` (rank 0's, from full_state);
    `lm_head`: the target's, attached as the method's model needs it (DraftMethod.attach_target)."""
    plain = method.build(draft.cfg, lm_head=lm_head)
    plain.load_state_dict(model)
    return plain
