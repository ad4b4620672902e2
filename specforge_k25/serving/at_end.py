"""The serving prediction's short form at the end of `train` and `eval`: a few lines for the
run's hw profile, or, on a profile without serving constants (the CPU default), for Kimi-K2.5 on
both GPU profiles as if the head's acceptance were measured behind it."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import CONF_DIR, HwConfig, TargetConfig

GPU_PROFILES = ("rtxpro6000x8", "b300x8")


def profile_hw(name: str) -> HwConfig:
    """A conf/hw profile's hw.* fields on the schema's defaults (no Hydra: this runs inside
    train's and eval's own Hydra apps)."""
    from omegaconf import OmegaConf

    node = OmegaConf.merge(OmegaConf.structured(HwConfig), OmegaConf.load(Path(CONF_DIR) / "hw" / f"{name}.yaml").hw)
    return OmegaConf.to_object(node)


def _kimi_job(job, hw_name: str):
    from ..draft.registry import method_of_spec

    return replace(job, hw=profile_hw(hw_name), target=TargetConfig(name="kimi_k25", builtin="none"),
                   draft=method_of_spec(job.draft).spec_class())  # the method's sizes for Kimi


def short_form(job, folder: str | Path) -> list[str]:
    """The lines to print for the head measured in `folder` (a run or eval folder); never raises:
    a prediction that cannot be made is one line saying why."""
    from . import predict_job
    from .report import short_lines

    has_constants = job.hw.peak_tflops and job.hw.memory_gbps and job.hw.link_gbps
    here = f"+hw={job.hw.name} target={job.target.name} " + (f"target.path={job.target.path} " if job.target.path else "")
    targets = [(job, here)] if has_constants else [(_kimi_job(job, name), f"+hw={name} target=kimi_k25 ")
                                                 for name in GPU_PROFILES]
    lines = []
    for j, args in targets:
        try:
            result = predict_job(j, run=str(folder), command_args=f"{args}serving.run={folder}")
        except Exception as err:  # the run's result stands; the prediction is an addition to it
            lines.append(f"serving prediction ({j.hw.name}): not made: {' '.join(str(err).split())}")
            continue
        lines += short_lines(result)
    return lines
