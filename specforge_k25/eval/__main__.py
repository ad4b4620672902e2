"""`python -m specforge_k25.eval export_dir=<run>/export [target=...] [+hw=...] [eval.key=value ...]`

The same Hydra config tree as `train` (so the target, data and hardware overrides are the
ones the head was trained with) plus `export_dir` and the `eval` group; `--help` lists them.
Prints the acceptance-length table, writes eval.json, eval.md and eval.png.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from ..config import CONF_DIR, EvalJobConfig, check_moved_keys, describe, register_schemas, run_hydra_main
from .report import markdown_table, plot, print_table

register_schemas()


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..stream.channel import bars_with_a_thread_lock
    from .run import run_eval

    bars_with_a_thread_lock()
    try:
        job: EvalJobConfig = OmegaConf.to_object(cfg)  # a size out of range is refused here, by name
        out_dir = Path(job.eval.output or HydraConfig.get().runtime.output_dir)
        results = run_eval(job, out_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"specforge_k25.eval: {err}", file=sys.stderr)
        sys.exit(2)
    print_table(results)
    (out_dir / "eval.md").write_text(markdown_table(results))
    plot(results, out_dir / "eval.png")
    print(f"eval: results in {out_dir}/eval.json, eval.md, eval.png")
    from ..serving.at_end import short_form

    if any(r.get("method") == "trained" and r.get("acc") for r in results["rows"]):  # a head was replayed
        print("\n".join(short_form(job, out_dir)), flush=True)


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        print("\n".join(describe(EvalJobConfig)))
        sys.exit(0)
    try:
        check_moved_keys(sys.argv[1:])
    except ValueError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        sys.exit(2)
    run_hydra_main(main)
