"""Learning curves: held-out acc_k and tau_sim against training tokens, per draft method and recipe.

Each recipe is one `python -m specforge_k25.train` run (the README's command 1 plus the recipe's
overrides) with held-out evaluations every `train.eval_every` steps: the curve is read from its
`metrics.jsonl` (the `eval/*` lines, each with `eval/tokens_trained`), so one run gives every point
of its curve. `--eval` then measures every final head's acceptance length in SGLang against
prompt-lookup n-gram with one `python -m specforge_k25.eval` (the heads as `eval.heads`, on the
same greedy outputs; same prompts and settings as the eval's defaults). A regenerating recipe after
the first trains on the first one's saved answers (`data.regen_source`): decoded once, and that
time is in the first one's wall time.

    .venv/bin/python benchmarks/learning.py                       # every recipe, full size (~10-20 min each on 2 cores)
    .venv/bin/python benchmarks/learning.py --recipes eagle3,eagle3_wsd --eval
    .venv/bin/python benchmarks/learning.py --reuse eagle3=RUN_DIR  # read a finished run instead of training
    .venv/bin/python benchmarks/learning.py --small               # tiny target and data (the test, ~1 min)
    .venv/bin/python benchmarks/learning.py --replot              # redraw the plot from the JSON

Writes a table, JSON (benchmarks/results/learning.json) and a plot beside it (if matplotlib is
installed). No assertion on any number; every point is reproducible from the recorded command.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, machine_info, new_figure, print_table, replot, save_figure, write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = RESULTS / "learning.json"
SMALL_OUT = RESULTS / "learning_small.json"
REGEN = ("data.regenerate=true",)
COSINE = ("train.lr_schedule=cosine",)  # the CPU default's schedule before WSD: the runs measured with it keep it
DFLASH = ("draft=dflash", *REGEN, *COSINE)

# name -> (method, overrides of README command 1). `eagle3` is command 1 as it is (WSD);
# `head` starts the EAGLE-3 lm_head from the target's rows of the draft vocabulary. The DFlash
# recipes train on the target's own answers (as DFlash is meant to be trained); `pos1x4` weighs
# the first drafted token 4x the others.
RECIPES = {
    "eagle3": ("eagle3", ()),
    "eagle3_cosine": ("eagle3", COSINE),
    "eagle3_head": ("eagle3", ("draft.head_from_target=true",)),
    "eagle3_head_cosine": ("eagle3", ("draft.head_from_target=true", *COSINE)),
    "eagle3_regen": ("eagle3", (*REGEN, *COSINE)),
    "dflash": ("dflash", DFLASH),
    "dflash_distill": ("dflash", (*DFLASH, "draft.distill=0.5")),
    "dflash_distill_only": ("dflash", (*DFLASH, "draft.distill=1.0")),
    "dflash_pos1x4": ("dflash", (*DFLASH, "draft.loss_weights=[4,1,1,1,1,1,1]")),
    "dflash_wsd": ("dflash", ("draft=dflash", *REGEN, "train.lr_schedule=wsd")),
}
DEFAULT_RECIPES = ("eagle3", "eagle3_cosine", "eagle3_head", "dflash", "dflash_distill", "dflash_pos1x4")

# --small: the tiny DeepSeek target of the end-to-end test, 12 samples, an evaluation every 2 steps
SMALL = ("target=tiny_deepseek", "data.num_samples=12", "data.heldout_samples=4", "data.max_length=96",
         "train.batch_size=2", "train.eval_every=2")
SMALL_EAGLE = ("draft.vocab_size=2048", "draft.ttt_length=3")
SMALL_DFLASH = ("draft.block_size=4", "draft.num_anchors=16", "data.regen_max_new_tokens=24")
SMALL_RECIPES = {
    "eagle3_wsd": ("eagle3", ("train.lr_schedule=wsd", *SMALL_EAGLE)),
    "dflash_distill": ("dflash", (*DFLASH, "draft.distill=0.5", "draft.loss_weights=[2,1,1]",
                                  *SMALL_DFLASH)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", default=None,
                   help=f"comma-separated recipe names (default {','.join(DEFAULT_RECIPES)}); known: {', '.join(RECIPES)}")
    p.add_argument("--reuse", action="append", default=[], metavar="NAME=RUN_DIR",
                   help="read recipe NAME's curve from a finished run folder instead of training it")
    p.add_argument("--extra", action="append", default=[], metavar="OVERRIDE",
                   help="an override added to every run (e.g. train.max_steps=100)")
    p.add_argument("--eval", action="store_true", help="also SGLang's AL of each final head vs n-gram (python -m specforge_k25.eval)")
    p.add_argument("--eval-prompts", type=int, default=8, help="prompts per set for --eval (eval.num_prompts)")
    p.add_argument("--work", type=Path, default=None, help="run folders (default: a fresh outputs/learning_<time> folder of the checkout)")
    p.add_argument("--small", action="store_true", help="tiny target and data (the test)")
    p.add_argument("--no-share-answers", action="store_true",
                   help="every regenerating recipe decodes its own answers (default: the later ones train on the "
                        "first one's saved answers, data.regen_source; its decode time is in its wall time)")
    p.add_argument("--replot", action="store_true", help="redraw the plot from the saved JSON, measure nothing")
    p.add_argument("--out", type=Path, default=None, help=f"JSON result (default {DEFAULT_OUT}; small {SMALL_OUT})")
    args = p.parse_args(argv)
    args.out = args.out or (SMALL_OUT if args.small else DEFAULT_OUT)
    known = SMALL_RECIPES if args.small else RECIPES
    names = args.recipes.split(",") if args.recipes else list(known if args.small else DEFAULT_RECIPES)
    args.reuse = dict(r.split("=", 1) for r in args.reuse)
    unknown = [n for n in [*names, *args.reuse] if n not in known]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; known: {', '.join(known)}")
    args.names = list(dict.fromkeys([*args.reuse, *names]))  # reused first: a later recipe may train on their answers
    return args


def train_command(overrides, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "specforge_k25.train", *overrides, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir / 'hydra'}", "train.logger=none", "train.progress=false"]


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` in the repository root, its output to `log`; -> wall seconds. Raises on failure."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}
    print("  $ " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"exit {code}: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def read_curve(run_dir: Path) -> dict:
    """The held-out evaluations of a run: one point per `eval/*` line of metrics.jsonl (a resumed
    run's repeated steps: the last line counts), and its summary (none for a run stopped early)."""
    points = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/tau_sim" in row:
            evals = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("eval/")}
            points[row["optimizer_step"]] = {"step": row["optimizer_step"], **evals}
    curve = [points[s] for s in sorted(points)]
    if not (run_dir / "summary.json").is_file():  # a run stopped before its end: its curve so far
        return {"points": curve, "steps": curve[-1]["step"], "tokens_trained": curve[-1].get("tokens_trained"),
                "train_wall_s": None, "total_wall_s": None, "tokens_per_s": None, "end": {}, "stopped": True}
    summary = json.loads((run_dir / "summary.json").read_text())
    for p in curve:  # a run from before eval/tokens_trained was logged: tokens at the mean rate (marked)
        if "tokens_trained" not in p:
            p["tokens_trained"] = round(summary["tokens_trained"] * p["step"] / max(1, summary["steps"]))
            p["tokens_estimated"] = True
    return {"points": curve, "steps": summary["steps"], "tokens_trained": summary["tokens_trained"],
            "train_wall_s": summary["train_wall_s"], "total_wall_s": summary["total_wall_s"],
            "tokens_per_s": summary["tokens_per_s"], "end": summary["eval"].get("end", {})}


def read_eval(out_dir: Path) -> dict:
    """Row name (a recipe, ngram, nospec) -> {"<chain> <prompt set>": AL}: SGLang's (its verify
    steps), else the replayed one where the eval has only that (as its own table shows it)."""
    out = {}
    for r in json.loads((out_dir / "eval.json").read_text())["rows"]:
        out.setdefault(r["method"], {})[f"{r['chain']} {r['prompt_set']}"] = r.get("al_sglang", r.get("al_replay"))
    return out


def eval_command(result: dict, base: list[str], out: Path, prompts: int) -> list[str]:
    """One `python -m specforge_k25.eval` of every recipe's final head on the same greedy outputs
    (eval.heads, one row each, named by the recipe), beside nospec and prompt-lookup n-gram."""
    heads = [f"+eval.heads.{name}={r['run_dir']}/export" for name, r in result["recipes"].items()]
    return [sys.executable, "-m", "specforge_k25.eval", *[o for o in base if o.startswith(("target", "data"))],
            *heads, f"eval.output={out}", f"eval.num_prompts={prompts}", "eval.methods=[nospec,ngram]"]


def measure(args) -> dict:
    known = SMALL_RECIPES if args.small else RECIPES
    work = (args.work or ROOT / "outputs" / f"learning_{time.strftime('%Y%m%d_%H%M%S')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = [*(SMALL if args.small else ()), *args.extra]
    recipes = {}
    result = {"benchmark": "learning", "args": {"small": args.small, "extra": args.extra, "eval": args.eval},
              "work": str(work), "recipes": recipes, "machine": machine_info()}
    answers_from = None  # the first regenerating run: later ones train on its saved answers (decoded once)
    for name in args.names:
        method, overrides = known[name]
        overrides = [*base, *overrides]
        shared = answers_from if REGEN[0] in overrides and not args.no_share_answers else None
        if shared is not None:
            overrides.append(f"data.regen_source={recipes[shared]['run_dir']}")
        run_dir = Path(args.reuse.get(name) or work / name)
        command = train_command(overrides, run_dir)
        print(f"{name}: {'reading ' + str(run_dir) if name in args.reuse else 'training in ' + str(run_dir)}", flush=True)
        wall = None if name in args.reuse else run(command, work / f"{name}.log")
        rec = {"method": method, "overrides": overrides, "run_dir": str(run_dir), "reused": name in args.reuse,
               "command": "python -m specforge_k25.train " + " ".join(overrides), "wall_s": wall,
               "answers_from": shared,
               **read_curve(run_dir)}
        recipes[name] = rec
        write_json(args.out, result)  # each finished recipe kept, should a later one fail
        if REGEN[0] in overrides and answers_from is None:
            answers_from = name
    if args.eval:
        cmd = eval_command(result, base, work / "eval", args.eval_prompts)
        result["eval_command"] = "python -m specforge_k25.eval " + " ".join(cmd[3:])
        result["eval_wall_s"] = run(cmd, work / "eval.log")
        rows = read_eval(work / "eval")
        result["baselines"] = {m: rows.get(m, {}) for m in ("nospec", "ngram")}
        for name, rec in recipes.items():
            rec["al"] = rows.get(name, {})
        write_json(args.out, result)
    return result


def report(result: dict) -> None:
    rows = []
    for name, r in result["recipes"].items():
        for p in r["points"]:
            accs = [p[k] for k in sorted((k for k in p if k.startswith("acc_")), key=lambda k: int(k[4:]))]
            rows.append([name, p["step"], f"{p['tokens_trained']}{'~' if p.get('tokens_estimated') else ''}",
                         f"{p['tau_sim']:.3f}", " ".join(f"{a:.3f}" for a in accs[:4])])
    print_table("held-out curve (tokens ~ = estimated from the mean rate)",
                ["recipe", "step", "tokens", "tau_sim", "acc_0..3"], rows)
    rows = []
    for name, r in result["recipes"].items():
        end = r["points"][-1]
        rows.append([name, r["method"], r["steps"], r["tokens_trained"], r["train_wall_s"], r["total_wall_s"],
                     f"{end['acc_0']:.3f}", f"{end['tau_sim']:.3f}", _al_cells(r.get("al", {}))])
    print_table("final heads (SGLang AL over all prompt sets, per chain or block)",
                ["recipe", "method", "steps", "tokens", "train s", "run s", "acc_0", "tau_sim", "SGLang AL"], rows)
    if result.get("baselines"):
        print_table("baselines on the same prompts", ["row", "SGLang AL"],
                    [[m, _al_cells(al)] for m, al in result["baselines"].items()])


def _al_cells(al: dict) -> str:
    """'3/1/4 1.311  7/1/8 1.340' from {"<chain> <set>": AL}: the `all` set of each chain."""
    return "  ".join(f"{k.rsplit(' ', 1)[0]} {v:.3f}" for k, v in al.items() if k.endswith(" all") and v is not None)


def plot(result: dict, path: Path) -> None:
    try:
        fig, (ax_tau, ax_acc) = new_figure(2)
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    for name, r in result["recipes"].items():
        tokens = [p["tokens_trained"] for p in r["points"]]
        ax_tau.plot(tokens, [p["tau_sim"] for p in r["points"]], marker="o", label=name)
        ax_acc.plot(tokens, [p["acc_0"] for p in r["points"]], marker="o", label=name)
    for ax, what in ((ax_tau, "held-out tau_sim"), (ax_acc, "held-out acc_0")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        return replot(args.out, plot)
    result = measure(args)
    report(result)
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
