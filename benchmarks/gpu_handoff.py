"""c) of the GPU check (benchmarks/gpu_e2e.py): the slot hand-off between the target and the trainer.

Two slots, many batches: the producer (the SGLang target process) waits for a free slot and refills it
as soon as it comes back. For every batch the trainer copies the slot (`DraftLearner.make_batch`, plus
the final states) and recomputes the float64 checksum the producer recorded for it; a copy that read
the slot after it was handed back sees a later batch and fails.

On CUDA the copies are asynchronous. To give a missing synchronisation something to lose, the trainer
works on its own CUDA stream and delays that stream (`torch.cuda._sleep`) before each copy: a slot
handed back before the copy finished is overwritten by the producer first. The first half of the
batches goes through `make_batch` as training does (it synchronises before returning). The second half
plants the bug: the same device copies of the slot (what make_batch's `.to(device, float32)` does) on
the delayed stream, handed back with no synchronisation; it must lose batches, and the check reports
that as its power. (The plant cannot be make_batch with its explicit sync removed: its host-to-device
copies of the ids and lengths, from pageable memory, synchronise the stream too.) On CPU copies finish
before they return, so there is no plant to run (the CPU test of a copy still tied to the slot stands in).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from specforge_k25.setup.target import make_target_stream
from specforge_k25.stream.ring import slot_checksum
from specforge_k25.train.schedule import build_schedule
from specforge_k25.train.learner import build_learner

CLOCK_HZ = 2.0e9  # torch.cuda._sleep counts cycles; the H200's SM clock is ~1.98 GHz under load
MIN_PLANT_MISMATCHES = 2  # the plant must lose at least this many batches for the check to have power


def schedule(job, n: int) -> tuple[list[list[int]], int]:
    items, steps = build_schedule(n, 0, batch_size=job.train.batch_size, grad_accum=1, epochs=1, max_steps=None,
                                  eval_every=None, seed=job.train.seed)
    return [i.sample_ids for i in items], steps


def check_slots(job, setup, device: torch.device, n_batches: int, sleep_s: float, hf_batches: int,
                delay_s: float = 0.05, plant: bool | None = None):
    """-> (result, captured [(lengths, aux, final)] of the first `hf_batches` batches, plan).
    plant: None = on CUDA (the second half of the batches without the sync), False = never."""
    cuda = device.type == "cuda"
    plant = cuda if plant is None else plant
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, stream_slots=2))
    plan, steps = schedule(job, len(setup.data.train))
    plan = (plan * (n_batches // len(plan) + 1))[:n_batches]
    planted_from = n_batches // 2 if plant else n_batches
    trainer = build_learner(job, setup, steps, device)
    consumer = torch.cuda.Stream(device) if cuda else None
    captured, rows = [], []
    stream = make_target_stream(job, setup, setup.data.train, plan)
    with stream:
        for k, ((msg, aux, final), ids) in enumerate(zip(stream, plan)):
            if len(captured) < hf_batches:  # for a): raw states, copied (and finished) before anything else
                captured.append((list(msg.lengths), aux.clone(), final.clone()))
                if cuda:
                    torch.cuda.current_stream(device).synchronize()
            with torch.cuda.stream(consumer) if cuda else contextlib.nullcontext():
                if cuda:
                    torch.cuda._sleep(int(delay_s * CLOCK_HZ))  # the copies below wait on this stream
                final_copy = final.to(device, torch.float32, copy=True)  # DraftBatch keeps the teacher, not final
                if k < planted_from:  # as training: make_batch finishes its copies before it returns
                    aux_copy = trainer.make_batch([setup.data.train[i] for i in ids], msg.lengths, aux, final).aux_hidden
                else:  # the plant: the copy is still queued behind the delay when the slot goes back
                    aux_copy = aux.to(device, torch.float32, copy=True)
                stream.release(msg)
                time.sleep(sleep_s)  # the producer refills the slot meanwhile: a copy still tied to it would change
                got = slot_checksum(aux_copy, final_copy)  # float(): waits for this stream
            scale = (aux_copy.double().abs().sum() + final_copy.double().abs().sum()).item()
            rows.append((msg.checksum, got, abs(got - msg.checksum) <= 1e-9 * max(scale, 1.0)))
    return summarize(rows, planted_from, plant, sleep_s, delay_s if cuda else 0.0), captured, plan


def summarize(rows: list[tuple[float, float, bool]], planted_from: int, plant: bool, sleep_s: float,
              delay_s: float) -> dict:
    """rows: (producer checksum, trainer's checksum, match) per batch; the batches from `planted_from`
    on ran the plant. ok: every real copy matches and, with a plant, the plant lost enough batches."""
    real, planted = rows[:planted_from], rows[planted_from:]
    bad = [i for i, r in enumerate(real) if not r[2]]
    res = {"batches": len(real), "slots": 2, "sleep_s": sleep_s, "consumer_delay_s": delay_s,
           "mismatched_items": bad, "distinct_checksums": len({round(r[0], 6) for r in real}),
           "real_ok": not bad and len(real) > 0}
    if plant:
        lost = [i for i, r in enumerate(planted) if not r[2]]
        res["planted_no_sync"] = {"batches": len(planted), "mismatched_items": lost,
                                  "has_power": len(lost) >= MIN_PLANT_MISMATCHES}
    res["ok"] = res["real_ok"] and (not plant or res["planted_no_sync"]["has_power"])
    return res


def describe(c: dict) -> str:
    text = (f"c) slot checksums: {c['batches'] - len(c['mismatched_items'])}/{c['batches']} trainer copies match the "
            f"producer's ({c['slots']} slots, consumer stream delayed {c['consumer_delay_s']} s before each copy, "
            f"{c['distinct_checksums']} distinct)")
    p = c.get("planted_no_sync")
    if p is None:
        return text + "; planted no-sync variant: not on CPU (copies are synchronous)"
    return text + (f"; planted no-sync variant loses {len(p['mismatched_items'])}/{p['batches']} batches "
                   + ("(the check can fail)" if p["has_power"] else f"(< {MIN_PLANT_MISMATCHES}: the check has NO power)"))
