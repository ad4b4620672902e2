"""`serving.*`: what `python -m specforge_k25.serving` predicts (conf/serving.yaml), on top of the
training config tree (hw, target and draft profiles as for `train` and `plan`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import CONF_DIR, JobConfig, check_moved_keys, register_schemas
from ..fields import doc


@dataclass
class ServingConfig:
    run: Optional[str] = doc(None, "a train run folder (summary.json: the held-out per-position acceptance acc_0..), an eval folder (eval.json: the replayed acceptance of the trained head) or an export folder (its run's summary.json); null = serving.acceptance")
    acceptance: Optional[list] = doc(None, "per-position acceptance [a_1, ..., a_k] (a_i = P(drafted token i accepted | 1..i-1 were); AL = 1 + a_1 + a_1 a_2 + ...); replaces the run's")
    method: Optional[str] = doc(None, "a registered draft method that SGLang or vLLM serves (`draft=<method>`, listed by `python -m specforge_k25.train --help`) or ngram (prompt lookup, the reference); null = the run's head's method, else the draft profile's (conf/serving.yaml: draft=kimi)")
    depths: list = doc([1, 2, 3, 4, 5, 6, 7], "drafted tokens per step to consider: a chain drafter (EAGLE-3) chains of d steps (topk 1, d+1 draft tokens), a block drafter (DFlash) blocks of d+1, ngram d")
    concurrency: list = doc([1, 2, 4, 8, 16, 32, 64, 128, 256], "concurrent requests (batch size of a decode step)")
    context: list = doc([4096], "context lengths (tokens of KV per request); the first is the one the best-setting table and the plot show, the others are in the JSON")
    routing: str = doc("auto", "auto = the run's measured routing (routing.pt) when the run's target is the one predicted, else uniform | uniform = every token picks top-k experts uniformly and independently")
    out: Optional[str] = doc(None, "JSON file written with every prediction (a list `predictions`), the best settings and the serving commands; null = none")
    plot: Optional[str] = doc(None, "PNG of speedup vs concurrency per setting; null = serving.png beside serving.out, or none")


@dataclass
class ServingJobConfig(JobConfig):
    serving: ServingConfig = field(default_factory=ServingConfig)


def register_serving_schema() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    register_schemas()
    node = OmegaConf.structured(ServingJobConfig)
    node.draft = "???"
    ConfigStore.instance().store(name="serving_schema", node=node)


def compose_serving(overrides: list[str]) -> ServingJobConfig:
    """conf/serving.yaml with `overrides` (as `plan`: no Hydra output folder)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import inspect

    if len(inspect.signature(check_moved_keys).parameters) > 1:  # it checks the keys against a schema
        check_moved_keys(overrides, ServingJobConfig)
    else:
        check_moved_keys(overrides)
    register_serving_schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="serving", overrides=overrides))
