#!/usr/bin/env python
"""Multi-node launch of `python -m specforge_k25.train`: composes the torchrun and SGLang arguments
for each node, prints them (--dry-run) or runs this node's command (exec, no cluster layer).

Two layouts:

* --target-nodes 1 (default), data parallel: every node runs hw.target_replicas target replicas
  inside the node (TP hw.target_tp) and their trainer ranks: one per replica
  (hw.trainer_layout=dedicated) or one beside every TP rank (colocated). One torchrun per node:
      torchrun --nnodes N --node-rank I --nproc-per-node R --rdzv-backend static
               --rdzv-endpoint MASTER:PORT -m specforge_k25.train OVERRIDES
* --target-nodes N (= --nodes), one target spanning the nodes: SGLang's multi-node tensor
  parallelism (hw.target_tp split over N nodes, hw.target_replicas=1). Node 0 runs the one trainer
  rank and TP ranks 0..tp/N-1; every other node runs only its TP ranks:
      node 0:  torchrun --nnodes 1 ... -m specforge_k25.train OVERRIDES hw.target_nnodes=N
               hw.target_node_rank=0 hw.target_dist_init_addr=MASTER:TARGET_PORT
      node I:  python -m specforge_k25.train.tp_node OVERRIDES hw.target_nnodes=N hw.target_node_rank=I
               hw.target_dist_init_addr=MASTER:TARGET_PORT

Example (print every node's command):
    python launch/multinode.py --nodes 2 --master-addr 10.0.0.1 --dry-run -- \\
        +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5
On each node (what launch/slurm_multinode.sbatch does through srun):
    python launch/multinode.py --nodes 2 --node-rank $NODE --master-addr 10.0.0.1 --iface eth1 -- OVERRIDES

--iface NAME: the network interface every process of the node talks to the other nodes over. The
launcher sets, for the command it runs and so for every process it starts (trainer ranks, target
processes, SGLang's schedulers): NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (the interface NCCL's
bootstrap/socket transport and gloo bind to) and SGLANG_HOST_IP (the address SGLang advertises to
the other nodes: its cross-node shared-memory broadcaster's publish socket, sglang
srt/distributed/device_communicators/shm_broadcast.py:192-195 via get_local_ip_auto, which reads
SGLANG_HOST_IP first, else the address of the route to a public IP: srt/utils/network.py:391-430).
SGLANG_HOST_IP is the interface's IPv4 address on the node that runs the command, read there.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class LaunchError(ValueError):
    """Bad launcher input (printed as `error: ...`, exit code 2)."""


@dataclass
class NodeCommand:
    node_rank: int
    role: str  # what the node runs, for the printed header
    argv: list[str]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/multinode.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compose (and on this node run) the torchrun / SGLang multi-node commands of "
                    "`python -m specforge_k25.train`.",
        epilog="Everything after `--` is passed to specforge_k25.train as Hydra overrides (e.g. +hw=rtxpro6000x8 "
               "target=kimi_k25 target.path=/models/Kimi-K2.5).")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's index, 0..nodes-1 (required to run; with --dry-run: print only this node)")
    parser.add_argument("--master-addr", default=None,
                        help="address of node 0, reachable from every node (required for more than one node)")
    parser.add_argument("--rdzv-port", type=int, default=29500, help="torchrun rendezvous port on node 0")
    parser.add_argument("--target-nodes", type=int, default=1,
                        help="nodes one target's TP group spans: 1 (data parallel, a target per node) or --nodes "
                             "(SGLang multi-node TP; the trainer on node 0)")
    parser.add_argument("--target-port", type=int, default=29600,
                        help="SGLang's TP rendezvous port on node 0 (hw.target_dist_init_addr) when --target-nodes > 1")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="trainer ranks per node; default: what the composed config's hw profile runs "
                             "(hw.target_replicas, x hw.target_tp when hw.trainer_layout=colocated)")
    parser.add_argument("--python", default="python", help="interpreter on the nodes (default: python)")
    parser.add_argument("--torchrun", default="torchrun", help="torchrun executable on the nodes (default: torchrun)")
    parser.add_argument("--iface", default=None,
                        help="network interface between the nodes (e.g. eth1, ib0): sets NCCL_SOCKET_IFNAME, "
                             "GLOO_SOCKET_IFNAME and SGLANG_HOST_IP (its IPv4 address on each node) for every process "
                             "the node starts; default: each library's own choice")
    parser.add_argument("--dry-run", action="store_true", help="print the commands of every node (or --node-rank's)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for specforge_k25.train (after --)")
    return parser.parse_args(argv)


def hw_layout(overrides: list[str]) -> tuple[int, int, int, bool]:
    """(hw.target_tp, hw.target_replicas, trainer ranks per node, co-located?) of the config the
    overrides compose (the same config the nodes will run: a bad override fails here, before any
    node starts)."""
    sys.path.insert(0, str(REPO))
    from specforge_k25.config import compose_job
    from specforge_k25.plan.budget import node_layout

    try:
        job = compose_job(overrides)
    except Exception as err:  # hydra's errors (unknown key, wrong type, missing group)
        raise LaunchError(f"the overrides do not compose: {err}") from None
    try:
        layout = node_layout(job.hw)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    return job.hw.target_tp, job.hw.target_replicas, layout.ranks_per_node, layout.colocated


def check_args(args: argparse.Namespace) -> None:
    """The launcher's own arguments (before the overrides are composed)."""
    n = args.nodes
    if n < 1:
        raise LaunchError(f"--nodes {n}: need at least one node")
    if args.node_rank is not None and not 0 <= args.node_rank < n:
        raise LaunchError(f"--node-rank {args.node_rank} is out of range for --nodes {n} (0..{n - 1})")
    if n > 1 and not args.master_addr:
        raise LaunchError(f"--nodes {n}: --master-addr (node 0's address, reachable from every node) is required")
    if args.target_nodes not in (1, n):
        raise LaunchError(f"--target-nodes {args.target_nodes}: use 1 (a target per node) or {n} (one target "
                          f"over all nodes)")
    for key in ("hw.target_nnodes", "hw.target_node_rank", "hw.target_dist_init_addr"):
        if any(o.lstrip("+~").startswith(key + "=") for o in args.overrides):
            raise LaunchError(f"{key} is set by the launcher (--target-nodes, --master-addr, --target-port): "
                              f"drop it from the overrides")
    if not args.dry_run and args.node_rank is None:
        if n != 1:
            raise LaunchError("--node-rank is required to run a node's command (or use --dry-run)")
        args.node_rank = 0


def node_commands(args: argparse.Namespace, target_tp: int, target_replicas: int, ranks_per_node: int | None = None,
                  colocated: bool = False) -> list[NodeCommand]:
    """Every node's command (`args` passed check_args)."""
    n = args.nodes
    master = args.master_addr or "127.0.0.1"
    rdzv = f"{master}:{args.rdzv_port}"
    train = ["-m", "specforge_k25.train", *args.overrides]

    if args.target_nodes == 1:
        per_node = args.nproc_per_node or ranks_per_node or target_replicas
        role = (f"{per_node} co-located trainer ranks beside {target_replicas} TP {target_tp} target replica(s)"
                if colocated else f"{per_node} trainer rank(s), each with a TP {target_tp} target replica")
        return [NodeCommand(i, role,
                            [args.torchrun, "--nnodes", str(n), "--node-rank", str(i), "--nproc-per-node",
                             str(per_node), "--rdzv-backend", "static", "--rdzv-endpoint", rdzv, *train])
                for i in range(n)]

    if colocated:
        raise LaunchError(f"--target-nodes {n}: co-located trainer ranks run beside a target on one node; "
                          f"add hw.trainer_layout=dedicated")
    if target_replicas != 1 or (args.nproc_per_node or 1) != 1:
        raise LaunchError(f"--target-nodes {n}: one target over all nodes has one trainer rank "
                          f"(hw.target_replicas=1, got {target_replicas})")
    if target_tp % n:
        raise LaunchError(f"hw.target_tp={target_tp} does not split evenly over {n} nodes")
    per_node = target_tp // n
    tp_args = [f"hw.target_nnodes={n}", f"hw.target_dist_init_addr={master}:{args.target_port}"]
    commands = [NodeCommand(0, f"the trainer rank + target TP ranks 0..{per_node - 1} of {target_tp}",
                            [args.torchrun, "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "1",
                             "--rdzv-backend", "static", "--rdzv-endpoint", rdzv, *train,
                             tp_args[0], "hw.target_node_rank=0", tp_args[1]])]
    for i in range(1, n):
        commands.append(NodeCommand(
            i, f"target TP ranks {i * per_node}..{(i + 1) * per_node - 1} of {target_tp} (no trainer)",
            [args.python, "-m", "specforge_k25.train.tp_node", *args.overrides,
             tp_args[0], f"hw.target_node_rank={i}", tp_args[1]]))
    return commands


NETWORK_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "SGLANG_HOST_IP")


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this machine (Linux SIOCGIFADDR)."""
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise LaunchError(f"--iface {name}: no such network interface on this node (it has: {', '.join(names)})")
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        except OSError as err:
            raise LaunchError(f"--iface {name}: the interface has no IPv4 address ({err.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def network_env(iface: str | None, address: str) -> dict[str, str]:
    """The variables --iface sets for every process of a node (`address`: the interface's there)."""
    if iface is None:
        return {}
    return dict(zip(NETWORK_ENV, (iface, iface, address)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(args)
        commands = node_commands(args, *hw_layout(args.overrides))
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.node_rank is not None:
        commands = [c for c in commands if c.node_rank == args.node_rank]
    if args.dry_run:
        for c in commands:
            print(f"# node {c.node_rank} of {args.nodes}: {c.role}")
            env = network_env(args.iface, f"<{args.iface}'s IPv4 address on node {c.node_rank}, read there>")
            if env:
                print("# environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
            print(shlex.join(c.argv))
        return 0
    (command,) = commands
    try:
        env = network_env(args.iface, interface_address(args.iface) if args.iface else "")
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.update(env)  # inherited by torchrun, its ranks and every target process they start
    print(f"node {command.node_rank} of {args.nodes}: {' '.join(f'{k}={v}' for k, v in env.items())}"
          f"{' ' if env else ''}{shlex.join(command.argv)}", flush=True)
    os.chdir(REPO)
    os.execvp(command.argv[0], command.argv)  # replaces this process: signals and exit code are torchrun's


if __name__ == "__main__":
    sys.exit(main())
