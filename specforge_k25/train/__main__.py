"""`python -m specforge_k25.train [+hw=...] [target=...] [group.key=value ...]`
A profile with several trainer ranks per node (hw.trainer_layout=colocated: one beside every TP
rank; dedicated: one per hw.target_replicas) starts them itself with torchrun on this node;
`torchrun --nproc-per-node N -m specforge_k25.train ...` does the same by hand (several nodes:
launch/multinode.py).

Hydra composes conf/config.yaml; the structured schema (specforge_k25/config.py) rejects
unknown keys (`+key=value` too) and wrong types, in one line with exit code 2. `--help` lists every
field with its one-line doc.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from ..config import (CONF_DIR, JobConfig, check_composed, check_moved_keys, describe, register_schemas,
                      run_hydra_main)

register_schemas()


def print_summary(summary: dict, target=None) -> None:
    """The end-of-run table; `target` (TargetConfig): a random embedded one says what its numbers mean."""
    from rich.console import Console
    from rich.table import Table

    from .overview import random_target_note

    table = Table(title="specforge_k25 run summary", show_lines=False)
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    data = summary["data"]
    table.add_row("samples trained", str(summary["samples_trained"]))
    table.add_row("tokens trained", str(summary["tokens_trained"]))
    table.add_row("optimizer steps", str(summary["steps"]))
    table.add_row("tokens/s (online, wall clock)", f"{summary['tokens_per_s']:.1f}")
    table.add_row("trainer waiting on target", f"{100 * summary['stream_wait_frac']:.0f}%")
    table.add_row("padding in the trainer's batches", f"{100 * summary['padding_share']:.1f}%")
    table.add_row("rows skipped (by reason)", str(data["skipped"] or "none"))
    if not data.get("heldout_samples"):
        table.add_row("held-out evaluation", "none (data.heldout_samples=0)")
    for tag in ("start", "end"):
        ev = summary["eval"].get(tag)
        if ev:
            label = "untrained head" if tag == "start" else "trained head"
            depth = sum(1 for key in ev if key.startswith("acc_"))  # the method's TTT steps or block positions
            table.add_row(f"held-out tau_sim ({label})", f"{ev['tau_sim']:.3f}")
            table.add_row(f"held-out acc_0..{depth - 1} ({label})",
                          " ".join(f"{ev[f'acc_{k}']:.3f}" for k in range(depth)))
    disk = summary["disk"]
    table.add_row("hidden-state bytes written to disk (target process, measured)", str(disk["hidden_state_bytes_on_disk"]))
    table.add_row("  hidden-state bytes streamed in memory", str(disk["hidden_state_bytes_streamed_in_memory"]))
    table.add_row("  trainer writes: checkpoints / other (smallest batch)",
                  f"{disk['trainer_checkpoint_bytes']} / {disk['trainer_other_write_bytes']} "
                  f"({disk['smallest_batch_hidden_state_bytes']})")
    if disk.get("trainer_answer_ids_bytes"):
        table.add_row("  trainer writes: regenerated answers' token ids", str(disk["trainer_answer_ids_bytes"]))
    table.add_row("  target startup writes (compile cache, temp probes)", str(disk["target_startup_write_bytes"]))
    table.add_row("checkpoint", summary["checkpoint"])
    table.add_row("export (SGLang/vLLM)", summary["export"])
    table.add_row("wall time (s)", f"{summary['total_wall_s']:.0f}")
    Console().print(table)
    note = random_target_note(target) if target is not None else None
    if note:  # under the table: it explains the held-out rows
        print(f"note: {note}", flush=True)


def relaunch_under_torchrun(hw, argv: list[str]) -> None:
    """Plain `python -m specforge_k25.train` on an `hw` profile with several trainer ranks per node:
    replace this process by torch's own launcher starting them (one node; never returns)."""
    from ..plan.budget import node_layout

    layout = node_layout(hw)
    ranks = layout.ranks_per_node
    if ranks == 1 or "LOCAL_RANK" in os.environ or hw.target_nnodes > 1:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "specforge_k25.train", *argv]
    stages = f" x {layout.pp} pipeline stages" if layout.pp > 1 else ""
    how = (f"one beside each of the {layout.tp} TP ranks{stages} of {layout.replicas} replica(s)"
           if layout.colocated else "one per target replica")
    print(f"hw={hw.name}: {ranks} trainer ranks ({how}); starting them with torchrun:\n  "
          f"{' '.join(['python', *cmd[1:]])}", flush=True)
    os.execv(sys.executable, cmd)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..setup.layout import World
    from ..stream.channel import bars_with_a_thread_lock
    from ..stream.target_stream import StreamError
    from .checkpoint import WriteFailed
    from .distributed import RankFailed
    from .finite import NonFiniteError
    from .stop import TrainingInterrupted
    from .run import run_training

    bars_with_a_thread_lock()
    try:
        check_composed(cfg)  # a +draft.KEY of another method
        job: JobConfig = OmegaConf.to_object(cfg)  # a size out of range is refused here, by name
        relaunch_under_torchrun(job.hw, sys.argv[1:])
    except ValueError as err:  # a field out of range; hw.trainer_layout not dedicated | colocated
        print(f"\nerror: {err}", file=sys.stderr)
        sys.exit(2)
    run_dir, lock = job.train.out_dir or HydraConfig.get().runtime.output_dir, None
    if not job.train.out_dir and World.from_env().rank == 0:  # Hydra's folder, a timestamp to the second
        from .run_lock import lock_default_folder

        lock, run_dir = lock_default_folder(run_dir)
    try:
        summary = run_training(job, run_dir, lock=lock)
    except TrainingInterrupted as stop:
        if World.from_env().rank == 0:  # the rank that saved
            print(f"\n{stop}\nresume with: python -m specforge_k25.train train.resume=auto train.out_dir={run_dir} "
                  f"(plus the same overrides)", file=sys.stderr)
        leave(128 + stop.signum)
    except StreamError as err:
        print(f"\ntarget engine failure: {err}", file=sys.stderr)
        leave(1)
    except RankFailed as err:  # torchrun: another trainer rank died or hung
        print(f"\ndata-parallel failure: {err}", file=sys.stderr)
        leave(1)
    except NonFiniteError as err:  # nothing exported; summary.json says failed
        if World.from_env().rank == 0:
            print(f"\nrun failed: {err}", file=sys.stderr)
        leave(1)
    except WriteFailed as err:  # a full disk, a permission, a vanished folder at a save or the export
        if World.from_env().rank == 0:
            print(f"\nrun failed: {err}", file=sys.stderr)
        leave(1)
    except (ValueError, FileNotFoundError) as err:  # configuration / data problems found before training
        print(f"\nerror: {err}", file=sys.stderr)
        leave(2)
    if World.from_env().rank == 0:
        print_summary(summary, job.target)
        from ..serving.at_end import short_form

        print("\n".join(short_form(job, run_dir)), flush=True)
    leave(0)


def leave(code: int) -> None:
    """Exit with `code`. A torchrun rank skips the interpreter's teardown (everything is written
    and closed by now): gloo and FSDP2 threads still alive then can abort a rank whose run
    succeeded (SIGABRT, "terminate called without an active exception"), which fails the launch."""
    from ..setup.layout import World

    sys.stdout.flush()
    sys.stderr.flush()
    if World.from_env().size > 1:
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        groups = sorted(p for p in Path(CONF_DIR).iterdir() if p.is_dir())
        print("Config groups (hw is added with +hw=NAME; the others replace the default with group=NAME):")
        from ..draft.registry import METHODS

        for group in groups:  # the draft group also holds each method's own config (draft=<method>)
            options = {f.stem for f in group.glob("*.yaml")} | (set(METHODS) if group.name == "draft" else set())
            print(f"  {group.name:<8} " + " | ".join(sorted(options)))
        print()
        print("Fields (override as group.field=value):")
        print("\n".join(describe()))
        sys.exit(0)
    try:
        check_moved_keys(sys.argv[1:], JobConfig)
    except ValueError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        sys.exit(2)
    run_hydra_main(main)
