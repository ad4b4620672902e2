"""The prediction as a person reads it: the rich table, the plot, the JSON, and the few lines
`train` and `eval` print at their end."""
from __future__ import annotations

import json
from pathlib import Path

from .predict import Prediction


def table(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    ctx = result["contexts"][0]
    preds = [p for p in result["predictions"] if p["context"] == ctx]
    settings = list(dict.fromkeys(p["setting"] for p in preds))
    conc = list(dict.fromkeys(p["concurrency"] for p in preds))
    t = Table(title=f"predicted decode speedup over no speculation: hw={result['hw']} TP{result['tp']}, "
                    f"target={result['target']}, context {ctx} (bold: the best setting; red: slower)")
    t.add_column("setting", no_wrap=True)
    t.add_column("AL", justify="right")
    for c in conc:
        t.add_column(f"C={c}", justify="right")
    best = {c: b["setting"] if b else None for c, b in ((int(k), v) for k, v in result["best"][str(ctx)].items())}
    for s in settings:
        row = {p["concurrency"]: p for p in preds if p["setting"] == s}
        cells = []
        for c in conc:
            x = row[c]["speedup"]
            cell = f"{x:.2f}"
            cell = f"[red]{cell}[/]" if x < 1 else cell
            cells.append(f"[bold]{cell}[/bold]" if best.get(c) == s else cell)
        t.add_row(escape(s), f"{row[conc[0]]['acceptance_length']:.2f}", *cells)
    base = {p["concurrency"]: p for p in preds if p["setting"] == settings[0]}
    t.add_section()
    t.add_row("no spec: tokens/s", "", *[f"{base[c]['baseline_tokens_per_s']:,.0f}" for c in conc])
    t.add_row("  decode step (ms)", "", *[f"{base[c]['decode_step_ms']:.1f}" for c in conc])
    t.add_row("  all-reduce share", "", *[f"{100 * base[c]['decode_allreduce_share']:.0f}%" for c in conc])
    t.add_row("[bold]best[/bold]", "", *[escape(best[c] or "off") for c in conc])
    console.print(t)
    for line in result["notes"]:
        console.print(f"  {escape(line)}")


def commands_text(result: dict) -> list[str]:
    cmds = result["commands"]
    if not cmds["settings"]:
        return ["serve without speculation: no setting is predicted to pay at any concurrency shown"]
    lines = []
    for s in cmds["settings"]:
        lines.append(f"{s['setting']} (best at concurrency {', '.join(map(str, s['concurrency']))}):")
        lines.append(f"  SGLang: {s['sglang']}")
        lines.append(f"  vLLM:   --speculative-config '{json.dumps(s['vllm_speculative_config'])}'")
    if "vllm_schedule" in cmds:
        sch = cmds["vllm_schedule"]
        lines.append(f"vLLM {sch['version']}, one server for every batch size (K=0: no speculation):")
        lines.append(f"  --speculative-config '{json.dumps(sch['speculative_config'])}'")
    return lines


def plot(result: dict, path: str | Path) -> Path | None:
    """Speedup vs concurrency per setting at the first context: log2 x axis, the 1.0 line, the area
    where speculation slows decoding shaded, the best setting per concurrency ringed and named."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ctx = result["contexts"][0]
    preds = [p for p in result["predictions"] if p["context"] == ctx]
    settings = list(dict.fromkeys(p["setting"] for p in preds))
    fig, ax = plt.subplots(figsize=(11, 5.4))
    cmap = plt.get_cmap("viridis")
    for i, s in enumerate(settings):
        pts = sorted((p["concurrency"], p["speedup"]) for p in preds if p["setting"] == s)
        ax.plot([c for c, _ in pts], [x for _, x in pts], marker="o", ms=3.5, lw=1.6,
                color=cmap(i / max(1, len(settings) - 1)), label=f"{s} (AL {next(p['acceptance_length'] for p in preds if p['setting'] == s):.2f})")
    lo = min(p["speedup"] for p in preds)
    ax.axhline(1.0, color="black", lw=1.2)
    ax.axhspan(min(lo, 0.95) - 0.05, 1.0, color="#f4cccc", alpha=0.5, zorder=0)
    ax.text(0.99, 0.02, "slower than no speculation", transform=ax.transAxes, ha="right", va="bottom",
            color="#990000", fontsize=8)
    for c, b in result["best"][str(ctx)].items():
        c = int(c)
        if b is None:
            ax.annotate("off", (c, 1.0), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8,
                        color="#990000")
        else:
            ax.plot([c], [b["speedup"]], marker="o", ms=11, mfc="none", mec="red", mew=1.6)
            ax.annotate(b["setting"].split(" ", 1)[1], (c, b["speedup"]), textcoords="offset points",
                        xytext=(0, 9), ha="center", fontsize=7, color="red")
    ax.set_xscale("log", base=2)
    conc = sorted({p["concurrency"] for p in preds})
    base = {p["concurrency"]: p["baseline_tokens_per_s"] for p in preds}
    ax.set_xticks(conc)
    ax.set_xticklabels([f"{c}\n{base[c]:,.0f}" for c in conc], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests  (below: tokens/s without speculation)")
    ax.set_ylabel("decode throughput vs no speculation")
    ax.set_title(f"Predicted speedup: {result['method']} on {result['target']}, hw={result['hw']} TP{result['tp']}, "
                 f"context {ctx}\nrouting: {result['routing']} (red rings: best setting; 'off': none pays)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="setting (acceptance length)",
              title_fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def short_lines(result: dict) -> list[str]:
    """The few lines at the end of train / eval: best setting per concurrency at the first context."""
    ctx = result["contexts"][0]
    best = result["best"][str(ctx)]
    runs: list[list] = []  # [first C, last C, setting or "off", best speedup in the span]
    for c, b in best.items():
        name, x = (b["setting"], b["speedup"]) if b else ("off", None)
        if runs and runs[-1][2] == name:
            runs[-1][1] = c
            runs[-1][3] = x if x is None else max(x, runs[-1][3])
        else:
            runs.append([c, c, name, x])
    spans = ", ".join(f"C={a}{'' if a == b else f'-{b}'}: {name}{'' if x is None else f' (up to {x:.2f}x)'}"
                      for a, b, name, x in runs)
    return [f"serving prediction (hw={result['hw']} TP{result['tp']}, target={result['target']}, context {ctx}, "
            f"acceptance {result['acceptance_source']}): {spans}",
            f"  details and serving commands: python -m specforge_k25.serving {result['command_args']}"]


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps({k: v for k, v in result.items()}, indent=1))


def as_dicts(predictions: list[Prediction]) -> list[dict]:
    return [p.as_dict() for p in predictions]
