"""`python -m specforge_k25.plan [+hw=...] [target=...] [group.key=value ...]`

Composes the same config as `python -m specforge_k25.train` (conf/ + the typed schema) and prints
the per-GPU memory budget, the SGLang `mem_fraction_static` it implies and the tokens per
optimizer step, then the throughput plan of both trainer layouts and of the fastest pipeline (PP)
shape that fits (plan/pipeline.py: predicted; it runs with hw.target_pp) with the layout it
predicts fastest (when the hw profile has its inputs: hw.peak_tflops, hw.memory_gbps,
hw.link_gbps), then every draft method (the `draft` group) in this run's place: trainable parameters,
peak GPU memory, the longest data.max_length that fits and node tokens/s. Starts nothing. Exit
status 0 when the run fits, 2 (with the override that would fit) when it does not.
"""
from __future__ import annotations

import math

import sys

from dataclasses import replace

from ..config import compose_job
from ..draft.registry import method_of_spec
from . import (PHASE_OPT, PHASE_TEACHER, PHASE_DRAFT, GiB, MemoryPlan, PlanError, check_fits, draft_param_counts,
               plan_memory, target_facts_for, with_hw_overrides)
from .budget import LAYOUTS, context_parallel, node_layout, with_layout
from .fit import length_binding, longest_fitting_length
from .choose import compare_methods
from .throughput import predict_layouts


def _g(n: int) -> str:
    return f"{n / GiB:,.2f}"


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, g in enumerate(ids):
        if start is None:
            start = g
        if i + 1 == len(ids) or ids[i + 1] != g + 1:
            out.append(str(start) if start == g else f"{start}-{g}")
            start = None
    return ",".join(out)


def render(job, plan: MemoryPlan) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    hw, f, d = job.hw, plan.facts, plan.draft
    console.print(f"[bold]memory plan[/bold]  hw={hw.name} ({hw.num_gpus} GPUs x {hw.gpu_memory_mib} MiB = "
                  f"{_g(hw.gpu_memory_mib << 20)} GiB)  target={f.name} ({f.num_layers} layers, Ht {f.hidden_size}, "
                  f"V {f.vocab_size}, weights {f.weight_bytes / 1e9:.1f} GB)  TP {hw.target_tp} x {hw.target_replicas} "
                  f"replica(s), trainer GPU(s) {hw.trainer_gpu_ids()}")
    console.print(f"run: batch {job.train.batch_size} x max_length {job.data.max_length} x grad_accum "
                  f"{job.train.grad_accum}, loss depth {plan.method.depth(job.draft, plan.draft)}, teacher chunk {job.train.teacher_chunk}, "
                  f"autocast {hw.autocast}, {job.train.stream_slots} stream slots")

    tr = job.train
    opt = f"on {tr.optimizer_device} with its own fp32 master" if tr.optimizer_device else "next to the weights"
    console.print(f"draft ({plan.method.name}): {plan.method.describe(d)}; fp32 weights and grads, AdamW m/v {opt}; "
                  f"frozen embedding in {hw.target_dtype} in host memory, the target's lm_head on the trainer GPU"
                  f"{' (co-located: its rows split over the ranks)' if plan.method.shards_target_head else ''}; activation "
                  f"checkpointing {'on' if tr.activation_checkpointing else 'off'}")
    params = Table()
    params.add_column("module")
    params.add_column("params", justify="right")
    counts = draft_param_counts(d, plan.method)
    for name, n in counts.items():
        params.add_row(name, f"{n:,}")
    params.add_row("trainable total", f"{sum(n for k, n in counts.items() if 'frozen' not in k):,}")
    console.print(params)

    # one column per distinct GPU role (identical budgets merged)
    columns: dict[tuple, list] = {}
    for g in plan.gpus:
        key = (g.role, tuple((i.name, i.bytes, i.phase) for i in g.items))
        columns.setdefault(key, []).append(g)
    table = Table(title="per-GPU memory (GiB); phase rows: only the largest phase of a GPU counts")
    table.add_column("item")
    groups = list(columns.values())
    for gs in groups:
        label = f"GPU {_ranges([g.gpu for g in gs])}" if gs[0].gpu >= 0 else "trainer"
        table.add_column(f"{label}\n{gs[0].role}", justify="right")
    table.add_column("note", overflow="fold", max_width=46)
    names: list[tuple[str, str | None]] = []
    notes: dict[tuple, str] = {}
    for gs in groups:
        for i in gs[0].items:
            if (i.name, i.phase) not in names:
                names.append((i.name, i.phase))
                notes[(i.name, i.phase)] = i.note
    order = [None, PHASE_TEACHER, PHASE_DRAFT, PHASE_OPT]
    for name, phase in sorted(names, key=lambda k: order.index(k[1]) if k[1] in order else len(order)):
        label = escape(name if phase is None else f"[{phase}] {name}")
        cells = []
        for gs in groups:
            n = sum(i.bytes for i in gs[0].items if i.name == name and i.phase == phase)
            present = any(i.name == name and i.phase == phase for i in gs[0].items)
            cells.append(_g(n) if present else "-")
        table.add_row(label, *cells, escape(notes[(name, phase)]))
    table.add_section()
    table.add_row("resident", *[_g(gs[0].resident()) for gs in groups], "")
    table.add_row("largest phase", *[f"{gs[0].peak_phase() or '-'}: {_g(max(gs[0].phases().values(), default=0))}"
                                     for gs in groups], "")
    table.add_row("[bold]peak total[/bold]", *[f"[bold]{_g(gs[0].total())}[/bold]" for gs in groups], "")
    if plan.gpus and plan.gpus[0].capacity:
        table.add_row("capacity", *[_g(gs[0].capacity) for gs in groups], "")
        table.add_row("[bold]headroom[/bold]", *[
            f"[{'green' if gs[0].headroom() >= 0 else 'red'}]{_g(gs[0].headroom())}[/]" for gs in groups], "")
    console.print(table)

    if plan.mem_fraction_static is not None:
        console.print(f"SGLang mem_fraction_static: derived {plan.mem_fraction_static:.2f} (SGLang's minimum "
                      f"{plan.mem_fraction_min:.4f} + hw.kv_pool_margin_gib={hw.kv_pool_margin_gib}; configured "
                      f"hw.mem_fraction_static={hw.mem_fraction_static}); "
                      f"KV pool {plan.kv_pool_tokens} tokens = {plan.kv_pool_tokens // plan.kv_page_size} pages of "
                      f"{plan.kv_page_size} token(s) (hw.max_total_tokens={hw.max_total_tokens}, raised to one batch "
                      f"in whole pages)")
    split = f" / context_parallel {hw.context_parallel}" if context_parallel(hw) > 1 else ""
    console.print(f"tokens per optimizer step: {plan.tokens_per_step:,} = batch {job.train.batch_size} x max_length "
                  f"{job.data.max_length} x grad_accum {job.train.grad_accum} x {len(node_layout(hw).trainer_gpus)} "
                  f"trainer rank(s){split} (upper bound: shorter samples give fewer)")
    for note in plan.notes:
        console.print(f"note: {escape(note)}")


def _memory_verdict(job, facts) -> str:
    """Whether `job`'s memory plan fits, the longest max_length that does, else the refusal's first lines."""
    longest = longest_fitting_length(job, facts)
    binds = length_binding(job, facts, longest)
    more = (f"; longest data.max_length that fits: {longest}" if longest else "") + (f" ({binds})" if binds else "")
    try:
        check_fits(job, facts)
        return "fits" + more
    except PlanError as err:  # the first problem and the override that fits, when named
        lines = [line.strip(" -") for line in str(err).splitlines()[1:]]
        fix = [line for line in lines if line.startswith(("fits with", "no single override"))]
        return "refused: " + "; ".join(lines[:1] + fix) + more


def render_throughput(job, facts) -> None:
    """Both TP layouts' and the fastest fitting pipeline layout's per-GPU seconds per token, node
    tokens/s, bottleneck, idle shares and bounds, and which layout the plan predicts fastest."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .choose import best_pipeline, predict_pipelines
    from .pipeline import NOT_RUNNABLE, PIPELINE_PARTS

    console = Console(width=max(Console().width, 140))
    try:
        layouts = predict_layouts(job, facts)
        pipelines = predict_pipelines(job, facts)
    except PlanError as err:
        console.print(f"throughput plan: {escape(str(err))}")
        return
    names = list(layouts)
    inputs = Table(title="throughput plan: inputs")
    inputs.add_column("input")
    for name in names:
        inputs.add_column(name, justify="right")
    inputs.add_column("source", overflow="fold", max_width=70)
    for rows in zip(*(layouts[n].inputs for n in names)):
        sources = list(dict.fromkeys(r[2] for r in rows))
        source = sources[0] if len(sources) == 1 else "; ".join(f"{n}: {r[2]}" for n, r in zip(names, rows))
        inputs.add_row(rows[0][0], *[r[1] for r in rows], escape(source))
    console.print(inputs)
    pipe = best_pipeline(job, facts, pipelines)
    if pipe is not None:
        pin = Table(title=f"throughput plan: {pipe.name} inputs besides the above ({NOT_RUNNABLE})")
        for col in ("input", "value", "source"):
            pin.add_column(col, justify="right" if col == "value" else "left", overflow="fold",
                           max_width=70 if col == "source" else 50)
        for row in pipe.throughput.inputs:
            pin.add_row(*(escape(x) for x in row))
        console.print(pin)

    shown = dict(layouts)
    if pipe is not None:
        shown[pipe.name] = pipe.throughput
    table = Table(title="throughput plan: microseconds per replica token on each GPU (a GPU does one thing at a time)")
    for col in ("layout", "GPUs", "role", *PIPELINE_PARTS, "busy", "idle"):
        table.add_column(col, justify="left" if col in ("layout", "GPUs", "role") else "right")
    for name, t in shown.items():
        merged: dict[tuple, list] = {}
        for g in t.gpus:
            merged.setdefault((g.role, tuple(round(v, 12) for v in g.parts.values())), []).append(g)
        for gs in merged.values():
            g = gs[0]
            table.add_row(name, _ranges([x.gpu for x in gs]), g.role,
                          *[f"{g.parts.get(p, 0.0) * 1e6:.1f}" for p in PIPELINE_PARTS],
                          f"{g.busy * 1e6:.1f}", f"{100 * t.idle(g):.0f} %")
        table.add_section()
    console.print(table)
    bound = next(iter(layouts.values())).compute_bound_tokens_per_s
    console.print(f"compute bound: {bound:,.0f} tokens/s per node (all {job.hw.num_gpus} GPUs busy on the target's "
                  f"and the trainer's FLOPs only, at hw.target_efficiency / hw.trainer_efficiency)")
    for name, t in layouts.items():
        g, part = t.bottleneck
        verdict = _memory_verdict(replace(job, hw=with_layout(job.hw, name)), facts)
        console.print(f"{name}: [bold]{t.tokens_per_s:,.0f} tokens/s[/bold] per node ({t.replicas} replica(s)); "
                      f"bottleneck GPU {g.gpu} ({part}); balanced bound {t.balanced_tokens_per_s:,.0f} tokens/s, "
                      f"{t.of_bound:.2f} of it; memory: {escape(verdict)}")
        console.print(f"  {t.of_compute_bound:.2f} of the compute bound")
        for note in t.notes:
            console.print(f"  note: {escape(note)}")
    if pipe is not None:
        console.print(f"{pipe.name}: {_pipeline_line(job, facts, pipe)}  [bold]{NOT_RUNNABLE}[/bold]")
        others = [p for p in pipelines if p is not pipe]
        if others:
            console.print("  other pipeline shapes: " + "; ".join(
                f"{p.name} {p.throughput.tokens_per_s:,.0f} tokens/s"
                + ("" if p.fits or job.hw.device != "cuda" else f" (does not fit: {p.memory_problems[0]})")
                for p in others))
    fast, slow = sorted(names, key=lambda n: -layouts[n].tokens_per_s)
    console.print(f"{fast} is faster: {layouts[fast].tokens_per_s / layouts[slow].tokens_per_s:.2f}x the {slow} "
                  f"layout's tokens/s (this run: hw.trainer_layout={job.hw.trainer_layout})")
    console.print(escape(_fastest_line(layouts, pipe)))


def _pipeline_line(job, facts, pipe) -> str:
    """A pipeline plan's tokens/s, bottleneck stage, start/drain and memory, one line."""
    from rich.markup import escape

    from .pipeline import first_stages_partition, longest_pipeline_length, predict_pipeline

    t, s = pipe.throughput, pipe.bottleneck_stage
    g = next(x for x in t.gpus if x.gpu == s * pipe.tp)
    part = max(g.parts, key=g.parts.get)
    a, b = pipe.split[s]
    line = (f"[bold]{t.tokens_per_s:,.0f} tokens/s[/bold] per node ({t.replicas} replica(s)), {t.of_compute_bound:.2f} "
            f"of the compute bound; {pipe.setting}; bottleneck stage {s} (layers {a}-{b - 1}; largest part: {part}); "
            f"start/drain {pipe.fill_s:.2f} s once per run")
    if pipe.memory is not None:
        full = max(pipe.memory, key=lambda x: x.total())
        longest = longest_pipeline_length(job, facts, pipe.pp, pipe.tp, pipe.replicas)
        line += (f"; memory: {'fits' if pipe.fits else 'does not fit: ' + escape('; '.join(pipe.memory_problems))}, "
                 f"fullest GPU {full.gpu} (stage {pipe.memory.index(full)}) {_g(full.total())} of {_g(full.capacity)} "
                 f"GiB, SGLang mem_fraction_static >= {pipe.mem_fraction_min:.2f}; longest data.max_length that "
                 f"fits: {longest or '-'}")
        alt = first_stages_partition(facts.num_layers, pipe.pp)
        if alt is not None and pipe.partition is None:
            other = predict_pipeline(job, facts, pipe.pp, pipe.tp, pipe.replicas, alt)
            longest_alt = longest_pipeline_length(job, facts, pipe.pp, pipe.tp, pipe.replicas, alt)
            line += (f" ({other.setting}: {other.throughput.tokens_per_s:,.0f} tokens/s, fullest GPU "
                     f"{_g(max(g.total() for g in other.memory))} GiB, longest {longest_alt or '-'})")
    return line


def _fastest_line(layouts: dict, pipe) -> str:
    """Which layout the plan predicts fastest and why (the part that binds the others)."""
    rates = {n: t.tokens_per_s for n, t in layouts.items()}
    if pipe is not None:
        rates[pipe.name] = pipe.throughput.tokens_per_s
    order = sorted(rates, key=lambda n: -rates[n])
    fast = order[0]

    def why(name: str) -> str:
        t = layouts.get(name) or pipe.throughput
        g, part = t.bottleneck
        return (f"{name} {rates[name]:,.0f} (bound by GPU {g.gpu}'s {part}: {g.parts[part] * 1e6:.1f} of "
                f"{g.busy * 1e6:.1f} us)")
    head = (f"predicted fastest: {fast}, {rates[fast] / rates[order[1]]:.2f}x the next ({why(order[1])}); "
            f"{why(fast)}")
    if pipe is not None and fast == pipe.name:
        s = pipe.bottleneck_stage
        a, b = pipe.split[s]
        head += (f": no all-reduce across the node (TP{pipe.tp} inside a stage), each GPU computes its stage's layers "
                 f"and 1/{len(pipe.throughput.gpus) // pipe.replicas} of its replica's trainer work; the "
                 f"{b - a}-layer stages set the rate. Run it with hw.target_pp={pipe.pp} hw.target_tp={pipe.tp}"
                 + (f" SGLANG_PP_LAYER_PARTITION={','.join(str(b - a) for a, b in pipe.split)}" if pipe.partition else "")
                 + (f" hw.mem_fraction_static={math.ceil(pipe.mem_fraction_min * 100) / 100}"
                    if pipe.mem_fraction_min and pipe.mem_fraction_min < 1 else "")
                 + "; the profile's default stays TP (hw.target_pp=1) until the pipeline has run on GPUs")
    return head + f"; slowest: {why(order[-1])}"


def render_methods(job, facts) -> None:
    """Every draft method in this run's place (plan/choose.py compare_methods)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    rows = compare_methods(job, facts)
    tr, L = job.train, job.data.max_length
    table = Table(title=f"draft methods on hw={job.hw.name} (memory: hw.trainer_layout={job.hw.trainer_layout}; "
                        f"batch {tr.batch_size} x max_length {L}, activation checkpointing "
                        f"{'on' if tr.activation_checkpointing else 'off'})")
    for col in ("method", "trainable params", "trainer GFLOP/token", "peak GPU GiB", f"fits at {L}",
                "longest max_length", *(f"{layout} tokens/s" for layout in LAYOUTS), "pipeline tokens/s (predicted)"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    notes = []
    for r in rows:
        name = r.method + (" (this run)" if r.method == method_of_spec(job.draft).name else "")
        if r.refused:
            table.add_row(name, *["-"] * (6 + len(LAYOUTS)))
            notes.append(f"{r.method}: {r.refused}")
            continue
        peak = f"{_g(r.peak_bytes)}" + (f" / {_g(r.capacity_bytes)}" if r.capacity_bytes else "")
        table.add_row(name, f"{r.trainable_params:,}", f"{r.trainer_flops_per_token / 1e9:.2f}", peak,
                      ("yes" if r.fits else "[red]no[/]") if r.capacity_bytes else "-",
                      str(r.longest_length or "-"),
                      *(f"{r.tokens_per_s[layout]:,.0f}" if layout in r.tokens_per_s else "-" for layout in LAYOUTS),
                      f"{r.pipeline_tokens_per_s:,.0f} ({r.pipeline.removeprefix('pipeline ')}"
                      f"{'' if r.pipeline_fits else ', [red]does not fit[/]'})" if r.pipeline_tokens_per_s else "-")
        notes.append(f"{r.method}: {r.describe}")
    console.print(table)
    for note in notes:
        console.print(f"  {escape(note)}")


def render_pipeline_run(job, facts) -> None:
    """hw.target_pp > 1: this run's stages (layers, per-stage memory) and, with the throughput
    inputs, its predicted tokens/s; the TP-layout tables do not describe it."""
    from rich.console import Console
    from rich.markup import escape

    from .pipeline import env_partition, pipeline_memory, pp_layer_split, predict_pipeline

    console = Console(width=max(Console().width, 140))
    hw = job.hw
    partition = env_partition(facts.num_layers, hw.target_pp)
    split = pp_layer_split(facts.num_layers, hw.target_pp, partition)
    console.print(f"[bold]pipeline run[/bold]  hw={hw.name}: {hw.target_pp} stages x TP {hw.target_tp}, a trainer "
                  f"rank beside each ({hw.trainer_layout}); layers per stage "
                  f"{', '.join(f'{a}-{b - 1}' for a, b in split)}")
    if hw.gpu_memory_mib > 0:
        budgets, problems, frac = pipeline_memory(job, facts, hw.target_pp, hw.target_tp, partition=partition)
        for s, g in enumerate(budgets):
            big = sorted((i for i in g.items if i.phase is None), key=lambda i: -i.bytes)[:3]
            console.print(f"  stage {s} (GPU {g.gpu}): {_g(g.total())} of {_g(g.capacity)} GiB; largest: "
                          + escape(", ".join(f"{i.name} {_g(i.bytes)}" for i in big)))
        console.print(f"  SGLang mem_fraction_static >= {frac:.2f} (hw.mem_fraction_static={hw.mem_fraction_static})")
    if hw.peak_tflops > 0 and hw.memory_gbps > 0 and hw.link_gbps > 0:
        pipe = predict_pipeline(job, facts, hw.target_pp, hw.target_tp, hw.num_gpus // (hw.target_pp * hw.target_tp),
                                partition)
        console.print(f"{pipe.name}: {_pipeline_line(job, facts, pipe)}")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print("Overrides as for `python -m specforge_k25.train` (see its --help); the plan uses hw.*, target.*, "
              "draft.*, data.max_length and train.{batch_size,grad_accum,teacher_chunk,stream_slots,"
              "activation_checkpointing,optimizer_device}; hw.trainer_layout=colocated plans the co-located layout.")
        return 0
    try:
        job = compose_job(argv)  # a size out of range is refused here, by name
    except ValueError as err:
        print(f"\nrefused: {err}", file=sys.stderr)
        return 2
    try:
        facts = with_hw_overrides(job.hw, target_facts_for(job.target))
        if job.hw.target_pp > 1:
            from .pipeline import check_pipeline_fits

            render_pipeline_run(job, facts)
            check_pipeline_fits(job, facts)
        else:
            render(job, plan_memory(job, facts))
            render_throughput(job, facts)
            render_methods(job, facts)
            check_fits(job, facts)
    except (PlanError, FileNotFoundError) as err:
        print(f"\nrefused: {err}", file=sys.stderr)
        return 2
    print("fits.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
