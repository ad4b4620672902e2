"""The run plan's throughput line (train/overview.py `throughput_line`): the plan's tokens/s at the
schedule's padding share beside none, and nothing where the profile has no throughput inputs; the
note a run on a random embedded target prints with its plan and its summary."""
from __future__ import annotations

from types import SimpleNamespace

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, predict
from specforge_k25.train.overview import throughput_line


def test_throughput_line_uses_the_padding_share():
    job = compose_job(["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi"])
    padded, full = (predict(job, KIMI_K25, padding_share=s).tokens_per_s for s in (0.2, 0.0))
    assert padded < full
    line = throughput_line(job, KIMI_K25, 0.2)
    assert f"planned {padded:,.0f} tokens/s" in line and "20% padding" in line and f"({full:,.0f} with none" in line
    pp = compose_job(["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.target_pp=2", "hw.target_tp=4"])
    assert "20% padding" in throughput_line(pp, KIMI_K25, 0.2)
    assert throughput_line(compose_job(["+hw=cpu"]), KIMI_K25, 0.2) is None


def _fake_setup():
    """Just what `print_overview` reads of a RunSetup, a draft and a schedule."""
    import torch

    from specforge_k25.train.schedule import BatchItem

    method = SimpleNamespace(name="eagle3", describe=lambda cfg: "1 layer", depth=lambda cfg, k: k,
                             num_aux=lambda cfg: 3)
    data = SimpleNamespace(train=[SimpleNamespace(input_ids=torch.zeros(8))], heldout=[], truncated=0,
                           turns_dropped=0, skipped={})
    info = SimpleNamespace(architecture="DeepseekV3ForCausalLM", num_layers=8, hidden_size=128, vocab_size=49152)
    setup = SimpleNamespace(data=data, info=info, model_path="/tiny", capture_points=[2, 4, 5],
                            sglang_capture_ids=[2, 4, 5], method=method, draft_cfg=None)
    draft = SimpleNamespace(trainable_parameters=lambda: [torch.zeros(4)],
                            embed_tokens=SimpleNamespace(weight=torch.zeros(2, 2)))
    return setup, draft, [BatchItem("train", [0])]


def test_a_random_tiny_target_says_acceptance_near_zero_is_expected(monkeypatch, capsys, tmp_path):
    """target=tiny_deepseek / tiny_kimi (seeded random weights): the run plan and the end-of-run
    summary say that held-out acceptance ~0 is expected; a real target (or a builtin's name
    with target.path set) prints no such line."""
    from specforge_k25.train import overview
    from specforge_k25.train.__main__ import print_summary

    monkeypatch.setattr(overview, "facts_from_folder", lambda *a: None)
    monkeypatch.setattr(overview, "throughput_line", lambda *a: None)
    summary = {"samples_trained": 4, "tokens_trained": 100, "steps": 2, "tokens_per_s": 10.0,
               "stream_wait_frac": 0.1, "padding_share": 0.0, "data": {"skipped": {}},
               "eval": {"end": {"tau_sim": 1.0, "acc_0": 0.0, "acc_1": 0.0, "acc_2": 0.0}},
               "disk": {"hidden_state_bytes_on_disk": 0, "hidden_state_bytes_streamed_in_memory": 1,
                        "trainer_checkpoint_bytes": 0, "trainer_other_write_bytes": 0,
                        "smallest_batch_hidden_state_bytes": 1, "target_startup_write_bytes": 0},
               "checkpoint": "c", "export": "e", "total_wall_s": 1.0}
    setup, draft, schedule = _fake_setup()
    for overrides, random in ((["target=tiny_deepseek"], True), (["target=tiny_kimi"], True),
                              (["target=smollm2"], False), (["target=tiny_deepseek", f"target.path={tmp_path}"], False)):
        job = compose_job(overrides)
        overview.print_overview(job, setup, schedule, 1, draft, tmp_path)
        plan = capsys.readouterr().out
        print_summary(summary, job.target)
        end = capsys.readouterr().out
        for out in (plan, end):
            assert ("is a random tiny fixture: acceptance ~0 is expected" in out) == random, (overrides, out)
        assert "held-out tau_sim (trained head)" in end and "run plan" in plan
