"""The stream's channels create no named semaphore, so a run killed with `kill -9` of its whole
process group (Slurm's escalation) leaves nothing in /dev/shm, and a torchrun rank that ends with
os._exit (train/__main__.py `leave`) leaves nothing for Python's resource tracker to warn about.

With multiprocessing queues, each ring held six named semaphores (/dev/shm/sem.mp-*), unlinked only
at a clean interpreter exit or by the resource tracker: a group SIGKILL killed both and left them.

target_stream._stop waits for target processes that are ending on their own: a SIGKILL during their
interpreter exit can land while multiprocessing releases a semaphore the process made (tqdm's lock),
which the tracker then reports as leaked at the trainer's exit (a flaky README-command failure).
"""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
import textwrap

# prepended to a script: `made` lists every named semaphore the script's process creates
RECORD_SEMAPHORES = textwrap.dedent("""
    import json
    from multiprocessing import synchronize

    made = []
    init = synchronize.SemLock.__init__
    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self._semlock.name)
    synchronize.SemLock.__init__ = recording
""")

RING_LIFE = RECORD_SEMAPHORES + textwrap.dedent("""
    import os, torch
    from specforge_k25.stream.ring import EndOfStream, SlotRing

    def produce(ring):
        ring.put(0, torch.ones(3, 12), torch.ones(3, 4), [3])
        ring.ready.put(EndOfStream(1, 0, 0))

    if __name__ == "__main__":
        ctx = torch.multiprocessing.get_context("spawn")
        ring = SlotRing(ctx, 2, 8, 4, torch.float32, num_aux=3)
        producer = ctx.Process(target=produce, args=(ring,))
        producer.start()
        producer.join(60)
        depth = [ring.depth()]
        msg = ring.get(timeout=10)
        depth.append(ring.depth())
        assert ring.view(msg)[0].sum().item() == 36
        ring.release(msg)
        end = ring.get(timeout=10)
        ring.close()
        ring.close()  # idempotent (TargetStream.close may run twice on a failure path)
        print(json.dumps({"made": made, "depth": depth, "end": type(end).__name__, "exit": producer.exitcode}),
              flush=True)
        os._exit(0)  # as a torchrun rank leaves: no interpreter teardown
""")


@pytest.mark.slow
def test_a_ring_with_its_producer_creates_no_named_semaphore(tmp_path):
    script = tmp_path / "ring_life.py"
    script.write_text(RING_LIFE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # the tracker's warning must show
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["exit"] == 0 and report["end"] == "EndOfStream" and report["depth"] == [1, 0], report
    assert report["made"] == [], "named semaphores (left in /dev/shm by a kill -9) created"
    assert "leaked" not in out.stderr and "resource_tracker" not in out.stderr, out.stderr


ENDING = textwrap.dedent("""
    import sys, time, torch
    from multiprocessing import util
    from specforge_k25.stream.target_stream import _stop

    def child(done):
        global lock
        lock = torch.multiprocessing.get_context("spawn").Lock()  # registered with the tracker; released at exit
        util.Finalize(None, time.sleep, (1.5,), exitpriority=5)  # a slow exit, before the lock's release (priority 0)
        done.set()

    if __name__ == "__main__":
        ctx = torch.multiprocessing.get_context("spawn")
        done = ctx.Event()
        p = ctx.Process(target=child, args=(done,))
        p.start()
        assert done.wait(60)
        time.sleep(0.3)  # the child is in its exit
        _stop([p], grace_s=float(sys.argv[1]))
        print("exit", p.exitcode, flush=True)
""")


def _stop_while_ending(tmp_path, grace_s: float) -> subprocess.CompletedProcess:
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, str(script), str(grace_s)], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.slow
def test_stop_lets_an_ending_target_process_release_its_semaphores(tmp_path):
    out = _stop_while_ending(tmp_path, 30.0)
    assert "exit 0" in out.stdout, out.stdout + out.stderr
    assert "leaked" not in out.stderr and "resource_tracker" not in out.stderr, out.stderr
    killed = _stop_while_ending(tmp_path, 0.0)  # the old behaviour: the tracker reports the lock
    assert "exit -9" in killed.stdout, killed.stdout + killed.stderr
    assert "leaked semaphore" in killed.stderr, killed.stderr


BARS = RECORD_SEMAPHORES + textwrap.dedent("""
    from tqdm import tqdm
    from specforge_k25.stream.target_process import bind_to_trainer

    bind_to_trainer()  # what every target process runs first (the trainer and the eval: bars_with_a_thread_lock)
    for _ in tqdm(range(3), desc="loading"):  # as SGLang's weight loading shows
        pass
    print(json.dumps(made), flush=True)
""")


def test_progress_bars_of_a_target_process_create_no_named_semaphore():
    """tqdm's default lock is a named semaphore; a target process (and the trainer) use a thread
    lock, so a kill -9 of the process group leaves no sem.mp-* file of theirs."""
    out = subprocess.run([sys.executable, "-c", BARS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
