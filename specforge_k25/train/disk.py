"""What a run wrote to disk, measured: the proof that no hidden state went there.

Measured from the processes' I/O counters (/proc/<pid>/io write_bytes, psutil) over the streaming
phase (first to last batch); shared memory is tmpfs and does not count. The target process
produces every hidden state, so its count is the hidden-state bytes on disk. The trainer's writes
other than its checkpoints, export and answer ids (filesystem metadata, temp probes) are shown
beside the smallest batch of hidden states: a spilled batch could not hide below it.
"""
from __future__ import annotations

from pathlib import Path

import psutil


def allocated_bytes(path: Path) -> int:
    """Bytes a folder occupies on disk (allocated blocks of its files and directories): what a
    process's write_bytes counter charges for writing it, page rounding included."""
    path = Path(path)
    return sum(p.stat().st_blocks * 512 for p in [path, *path.rglob("*")]) if path.exists() else 0


def written_bytes() -> int:
    """This process's write_bytes counter."""
    return psutil.Process().io_counters().write_bytes


def disk_summary(*, target_streaming: int, target_startup: int, trainer_written: int, checkpoint_bytes: int,
                 answer_bytes: int, smallest_batch_tokens: int, streamed_tokens: int, token_bytes: int) -> dict:
    """summary.json's "disk" (every count summed over the data-parallel ranks; `token_bytes`: the
    hidden-state bytes of one token as the method streams them, DraftMethod.streamed_bytes)."""
    return {"hidden_state_bytes_on_disk": target_streaming,
            "target_startup_write_bytes": target_startup,
            "trainer_checkpoint_bytes": checkpoint_bytes,
            "trainer_answer_ids_bytes": answer_bytes,
            "trainer_other_write_bytes": max(0, trainer_written - checkpoint_bytes - answer_bytes),
            "smallest_batch_hidden_state_bytes": smallest_batch_tokens * token_bytes,
            "hidden_state_bytes_streamed_in_memory": streamed_tokens * token_bytes}
