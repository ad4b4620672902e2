"""`python -m specforge_k25.train.tp_node [+hw=...] [target=...] hw.target_nnodes=N hw.target_node_rank=I
hw.target_dist_init_addr=HOST:PORT [...]`

A node of a target whose TP group spans nodes, other than node 0: it runs only this node's TP
ranks (hw.target_tp / hw.target_nnodes of them, on GPUs hw.target_gpu..), no trainer. It takes the
same overrides as `python -m specforge_k25.train` on node 0 (it builds the same engine from them,
setup/target.py `target_spec`), joins SGLang's rendezvous at hw.target_dist_init_addr, runs every
batch TP rank 0 broadcasts and exits 0 when rank 0 ends. A rank that fails stops the others and
exits 1 naming it. `launch/multinode.py` prints these commands.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    from ..config import compose_job
    from ..setup.target import target_spec
    from ..stream.target_stream import run_tp_node

    try:
        return run_tp_node(target_spec(compose_job(argv)))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"target engine failure: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
