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
                offload: bool = False, mesh: DeviceMesh | None = None,
                device: torch.device | str | None = None) -> nn.Module:
    """In place: shard the draft's trainable units over the default process group, or on `mesh`
    (default `data_parallel_mesh`: HSDP across nodes).
    bf16: gather the weights in bf16 (what autocast computes with anyway), reduce in fp32;
    keep_gathered: DraftMethod.keep_units_gathered (module doc); offload: the shards, their grads
    and the optimizer on the host (train.optimizer_device=cpu); device: where the shards live
    (None: where the weights are). No unit's weight reaches `device` whole: the units are sharded
    on the meta device and each rank's rows copied in from the host (`_materialise`)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    # pinned host shards copy to and from the GPU asynchronously; on a CPU run there is no device to pin for
    where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    if device is None:  # the weights' device
        device = next(p for p in draft.parameters() if p.requires_grad).device
    if mesh is None:  # the shards' device (the offloaded shards go to the host after)
        mesh = data_parallel_mesh(torch.device(device).type)
    covered = {n for n in trainable if any(n.startswith(unit + ".") for unit in units)}
    if covered != trainable:  # an unsharded trainable weight would get no gradient sum over ranks
        raise ValueError(f"trainable weights outside the FSDP units {units}: {sorted(trainable - covered)}")
    values = _to_meta(draft, trainable)
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
    _materialise(draft, values, torch.device("cpu") if offload else torch.device(device))
    return draft


def _to_meta(draft: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    """In place: the parameters `names` replaced by storage-less ones on the meta device (FSDP2
    shards those where they are: `_fsdp_init.py` `_move_states_to_device` keeps meta tensors);
    returns their values, by name, where they were."""
    values, swapped = {}, {}
    for prefix, module in draft.named_modules(remove_duplicate=False):
        for key, p in list(module._parameters.items()):
            name = f"{prefix}.{key}" if prefix else key
            if p is None or (name not in names and id(p) not in swapped):
                continue
            if id(p) not in swapped:  # a tied parameter stays one parameter
                swapped[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                values[name] = p.detach()
            module._parameters[key] = swapped[id(p)]
    return values


@torch.no_grad()
def _materialise(draft: nn.Module, values: dict[str, torch.Tensor], device: torch.device) -> None:
    """Each sharded parameter's local rows, cut from its value on the host and copied to `device`:
    the rows its placements give this rank (`_local_rows`). Assigned through load_state_dict,
    after which FSDP2 pads and registers the new local shard (`_fsdp_param.py`
    `reset_sharded_param`)."""
    from torch.distributed.tensor import DTensor

    params = dict(draft.named_parameters(remove_duplicate=False))
    by_module: dict[str, dict] = {}
    for name, value in values.items():
        p = params[name]
        # a copy even on the value's own device: a view would keep the whole parameter alive
        rows = _local_rows(value, p.device_mesh, p.placements).to(device, copy=True).contiguous()
        # as FSDP2 wraps its own shards (`_fsdp_common.py` `_from_local_no_grad`): the rows stay where
        # they are (DTensor.from_local would move host rows to the mesh's device)
        local = DTensor(rows, p._spec, requires_grad=False)
        prefix, _, key = name.rpartition(".")
        by_module.setdefault(prefix, {})[key] = nn.Parameter(local, requires_grad=p.requires_grad)
    for prefix, state in by_module.items():
        unexpected = draft.get_submodule(prefix).load_state_dict(state, strict=False, assign=True).unexpected_keys
        if unexpected:
            raise RuntimeError(f"sharding: {prefix or 'the draft'} has no parameters {unexpected}")


def _local_rows(value: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's part of `value` under `placements` on `mesh`: along each mesh dimension that
    shards dim d, chunk r of torch.chunk (ceil(n / size) each, the last ones shorter or empty),
    as FSDP2 (`_fsdp_param.py` `_init_sharded_param`, `_chunk_with_empty`) and DTensor cut it."""
    from torch.distributed.tensor import Shard

    for i, placement in enumerate(placements):
        if isinstance(placement, Shard):
            n, size, rank = value.shape[placement.dim], mesh.size(i), mesh.get_local_rank(i)
            per = -(-n // size)
            start = min(rank * per, n)
            value = value.narrow(placement.dim, start, min(per, n - start))
    return value


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
