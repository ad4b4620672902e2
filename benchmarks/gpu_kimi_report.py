"""benchmarks/gpu_kimi_shapes.py's figure and table of one method's result."""
from __future__ import annotations

from pathlib import Path

from _common import GiB, new_figure, print_table, save_figure


def plot(result: dict, path: Path) -> None:
    fig, (ax_t, ax_m) = new_figure(2, width=5.5)
    rows = [r for r in result["shapes"] if r["status"] == "ok"]
    labels = [str(r["seq_len"]) for r in rows]
    bottom = [0.0] * len(rows)
    teacher = "teacher (fp32)" if result["args"]["no_bf16"] else "teacher (bf16)"
    ttt = "TTT fwd+bwd (checkpointed)" if result["args"]["activation_checkpointing"] else "TTT fwd+bwd"
    for key, name in (("teacher_s", teacher), ("fwd_bwd_s", ttt), ("optim_s", "optimizer")):
        vals = [r[key] for r in rows]
        ax_t.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax_t.text(i, bottom[i], f"{r['tflops']:.0f} TF/s", ha="center", va="bottom", fontsize=8)
    ax_t.set_xlabel("T (tokens per step)")
    ax_t.set_ylabel("seconds per step (median)")
    ax_t.set_title(f"{result['device_name']}: draft step time")
    ax_t.legend(fontsize=8)
    all_rows = result["shapes"]
    labels = [str(r["seq_len"]) for r in all_rows]
    x = range(len(all_rows))
    measured = [(r.get("peak_bytes") or 0) / GiB if r["status"] == "ok" else 0 for r in all_rows]
    planned = [r["planned_bytes"] / GiB for r in all_rows]
    ax_m.bar([i - 0.2 for i in x], measured, width=0.4, label="measured peak")
    ax_m.bar([i + 0.2 for i in x], planned, width=0.4, label="planner")
    for i, r in enumerate(all_rows):
        if r["status"] != "ok":
            ax_m.text(i - 0.2, 0, r["status"], ha="center", va="bottom", fontsize=8, rotation=90)
    if result.get("device_memory_bytes"):
        ax_m.axhline(result["device_memory_bytes"] / GiB, color="k", ls="--", lw=1, label="device memory")
    ax_m.set_xticks(list(x), labels)
    ax_m.set_xlabel("T (tokens per step)")
    ax_m.set_ylabel("GiB")
    ax_m.set_title("peak memory")
    ax_m.legend(fontsize=8)
    save_figure(fig, path)


def print_report(result: dict) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = []
    for r in result["shapes"]:
        ok = r["status"] == "ok"
        peak = r.get("peak_bytes")
        rows.append([
            str(r["seq_len"]), r["status"], f(r.get("step_s"), ".3f"), f(r.get("teacher_s"), ".3f"),
            f(r.get("fwd_bwd_s"), ".3f"), f(r.get("optim_s"), ".3f"),
            f(peak / GiB if peak is not None and ok else None, ".1f"), f(r["planned_bytes"] / GiB, ".1f"),
            f(r["flops"]["total"] / 1e12, ".3g"), f(r.get("tflops"), ".3g"),
            f(100 * r["frac_of_bf16_matmul"] if ok else None, ".0f"),
        ])
    m = result["matmul"]
    print(f"\nmatmul rate ({m['n']}^3): bf16 {m['bf16_tflops']:.1f} TFLOP/s, fp32 {m['fp32_tflops']:.1f} TFLOP/s "
          f"(TF32 allowed: {m['fp32_allow_tf32']})")
    c = result["draft"]
    print(f"draft: H {c['hidden_size']}, heads {c['num_attention_heads']}/{c['num_key_value_heads']} x {c['head_dim']}, "
          f"I {c['intermediate_size']}, Vd {c.get('draft_vocab_size', c['vocab_size'])}, V {c['vocab_size']}, "
          f"layers {c.get('num_hidden_layers', 1)}; "
          f"{result['trainable_params'] / 1e6:.0f}M trainable; batch {result['args']['batch']}, "
          f"K {result['args']['ttt_length']}, bf16 autocast {not result['args']['no_bf16']}, "
          f"teacher chunk {result['args']['teacher_chunk']}; frozen embedding / lm_head {result['frozen_dtype']}; "
          f"activation checkpointing {result['args']['activation_checkpointing']}; "
          f"AdamW state on {result['optimizer_device'] or 'the trainer device'}")
    print_table(
        f"{result['device_name']}: one draft training step (median of {result['args']['iters']} after "
        f"{result['args']['warmup']} warm-up)",
        ["T", "status", "step s", "teacher s", "fwd+bwd s", "optim s", "peak GiB", "plan GiB", "TFLOP/step",
         "TFLOP/s", "% bf16 mm"], rows)
