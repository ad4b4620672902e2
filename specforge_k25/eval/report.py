"""The acceptance-length table (terminal, markdown) and a bar chart."""
from __future__ import annotations

from pathlib import Path

NOTE = ("AL = Σ completion tokens / Σ verify steps, temperature 0, measured by SGLang's speculative "
        "decoding with each head (the prefill's token counts as a completion token, as in SGLang). "
        "r = the same AL replayed from our draft's own proposals on the greedy outputs; "
        "τ = τ_sim from acc_k on those outputs (as training logs it); "
        "ngram = prompt lookup replayed on the greedy outputs (greedy verification makes that exact); "
        "nospec = 1.0 by definition; chain `block B` = a block drafter (DFlash) proposing B-1 tokens per step. "
        "A '≠k' marks k prompts whose speculative output differed from greedy.")


def _grid(results: dict):
    sets = list(results["prompt_sets"]) + ["all"]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results["rows"]:
        rows.setdefault((r["method"], r["chain"]), {})[r["prompt_set"]] = r
    return sets, rows


def _al(cell: dict) -> float | None:
    return cell.get("al_sglang", cell.get("al_replay"))


def _cell_text(cell: dict | None) -> str:
    if not cell:
        return "-"
    text = f"{_al(cell):.3f}" if _al(cell) is not None else "-"
    extra = []
    if "al_sglang" in cell and "al_replay" in cell:
        extra.append(f"r {cell['al_replay']:.3f}")
    if "tau_sim" in cell:
        extra.append(f"τ {cell['tau_sim']:.3f}")
    if cell.get("outputs_differ_from_greedy"):
        extra.append(f"≠{cell['outputs_differ_from_greedy']}")
    return text + (f" ({', '.join(extra)})" if extra else "")


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    sets, rows = _grid(results)
    table = Table(title=f"acceptance length, {results['max_new_tokens']} greedy tokens per prompt")
    for col in ["method", "chain", *sets]:
        table.add_column(col, justify="left" if col in ("method", "chain") else "right")
    for (method, chain), cells in rows.items():
        table.add_row(method, chain, *(_cell_text(cells.get(s)) for s in sets))
    console = Console()
    console.print(table)
    console.print(NOTE, style="dim")


def markdown_table(results: dict) -> str:
    sets, rows = _grid(results)
    lines = ["| method | chain | " + " | ".join(f"{s} ({results['prompt_sets'].get(s, sum(results['prompt_sets'].values()))})"
                                                 for s in sets) + " |",
             "|---|---|" + "---:|" * len(sets)]
    for (method, chain), cells in rows.items():
        lines.append(f"| {method} | {chain} | " + " | ".join(_cell_text(cells.get(s)) for s in sets) + " |")
    return "\n".join(lines) + "\n\n" + NOTE + "\n"


def plot(results: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, rows = _grid(results)
    labels = [f"{m} {c}" if c != "-" else m for m, c in rows]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(labels), 3.6))
    width = 0.8 / len(sets)
    for j, s in enumerate(sets):
        values = [(_al(cells[s]) or 0) if s in cells else 0 for cells in rows.values()]
        ax.bar([i + j * width for i in range(len(labels))], values, width, label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("acceptance length")
    ax.set_title("SGLang speculative decoding: acceptance length (temperature 0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
