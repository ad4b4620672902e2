"""`python -m specforge_k25.stream.tp_node [+hw=...] [target=...] hw.target_nnodes=N hw.target_node_rank=I
hw.target_dist_init_addr=HOST:PORT [...]`

A node of a target whose TP group spans nodes, other than node 0: it runs only this node's TP
ranks (hw.target_tp / hw.target_nnodes of them, on GPUs hw.target_gpu..), no trainer. It takes the
same overrides as `python -m specforge_k25.train` on node 0 (it builds the same engine from them),
joins SGLang's rendezvous at hw.target_dist_init_addr, runs every batch TP rank 0 broadcasts and
exits 0 when rank 0 ends the plan. A rank that fails stops the others and exits 1 naming it.
`launch/multinode.py` prints these commands.
"""
from __future__ import annotations

import sys


def load_job(overrides: list[str]):
    """The JobConfig the trainer's node composes from the same overrides (no Hydra output folder)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ..train.__main__ import CONF_DIR  # registers the structured schema

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def node_spec(job):
    """This node's TargetSpec: the model, capture points and engine settings `train` uses."""
    from ..target.hf_config import read_target_info
    from ..target.layers import default_capture_points, validate_capture_points
    from ..train.loop import resolve_target_path
    from .producer import target_spec

    model_path = resolve_target_path(job)
    info = read_target_info(model_path)
    points = validate_capture_points(job.target.aux_layers or default_capture_points(info.num_layers), info.num_layers)
    return target_spec(job, model_path, info.architecture, points)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    from .producer import run_tp_node

    try:
        return run_tp_node(node_spec(load_job(argv)))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"target engine failure: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
