"""`python -m specforge_k25.serving +hw=rtxpro6000x8 [target=kimi_k25] serving.run=<folder> [serving.key=value ...]`

Will this head pay on my node? From the head's per-position acceptance (a train run folder, an
eval folder or an export folder: serving.run; or serving.acceptance=[a_1,...]) and the hw and
target profiles, prints the predicted decode speedup over no speculation for each setting the
method is served with (serving.method=<a draft method> | ngram) at each concurrency and context,
the best setting per concurrency ("off" where none pays), and the serving commands (SGLang flags,
vLLM speculative_config and its per-batch-size schedule); writes a plot and, with serving.out=FILE,
the JSON. The model and its assumptions: docs/PERFORMANCE.md §9. Starts nothing. Exit status 2
with one line on bad input.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        from ..config import describe
        from ..fields import field_lines
        from .config import ServingConfig

        print(__doc__)
        print("Fields (override as group.field=value):")
        print("\n".join(field_lines(ServingConfig, "serving.")))
        print("The hw profile's serving constants (hw.*) and the rest of the training config tree:")
        print("\n".join(line for line in describe() if line.lstrip().startswith(("hw.", "target."))))
        return 0
    from . import predict_job
    from .config import compose_serving
    from .report import commands_text, plot, table, write_json

    try:
        job = compose_serving(argv)
        result = predict_job(job, command_args=" ".join(argv))
    except (ValueError, FileNotFoundError) as err:  # ServingError, PlanError and a bad field are ValueErrors
        print(f"specforge_k25.serving: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    table(result)
    for line in commands_text(result):
        print(line)
    sv = job.serving
    if sv.out:
        write_json(result, sv.out)
        print(f"predictions: {sv.out}")
    png = sv.plot or (str(Path(sv.out).with_suffix(".png")) if sv.out else None)
    if png:
        written = plot(result, png)
        print(f"plot: {written}" if written else "plot: matplotlib is not installed, none written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
