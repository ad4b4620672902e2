"""The trainer's side of the stream leaves no semaphore for Python's resource tracker to warn about.

SlotRing.close releases the ring's named semaphores at once, not at interpreter exit.

A torchrun rank ends with os._exit (train/__main__.py `leave`), which skips the finalizers that
would unlink the semaphores of the ring's two multiprocessing queues; every co-located or
data-parallel run then ended with Python's resource tracker warning "There appear to be 6 leaked
semaphore objects". The test runs a ring's whole life in a process that ends the same way.

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

SCRIPT = textwrap.dedent("""
    import json, os, torch
    from specforge_k25.stream.ring import SlotRing

    ring = SlotRing(torch.multiprocessing.get_context("spawn"), 2, 8, 4, torch.float32, num_aux=3)
    ring.put(0, torch.ones(3, 12), torch.ones(3, 4), [3])  # both queues' feeder threads start
    msg = ring.get(timeout=10)
    assert ring.view(msg)[0].sum().item() == 36
    ring.release(msg)
    names = [lock._semlock.name for q in (ring.free, ring.ready) for lock in (q._rlock, q._wlock, q._sem)]
    ring.close()
    ring.close()  # idempotent (TargetStream.close may run twice on a failure path)
    still = [n for n in names if os.path.exists("/dev/shm/sem." + n.lstrip("/"))]
    print(json.dumps({"names": names, "still": still}), flush=True)
    os._exit(0)  # as a torchrun rank leaves: no interpreter teardown
""")


def test_closed_ring_leaves_no_semaphore_behind():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # the tracker's warning must show
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["names"]) == 6
    assert report["still"] == [], "semaphores still linked after close"
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
