"""The run plan's throughput line (train/overview.py `throughput_line`): the plan's tokens/s at the
schedule's padding share beside none, and nothing where the profile has no throughput inputs."""
from __future__ import annotations

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
