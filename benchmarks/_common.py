"""Small helpers shared by the benchmark scripts: threads, machine facts, tables, JSON, plots.

The scripts run as `python benchmarks/NAME.py`, so this module is imported as `_common`
(the script's folder is first on sys.path).
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 1 << 30
MiB = 1 << 20


def set_threads(n: int) -> None:
    """Intra-op threads of this process (and the default for processes it spawns)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def machine_info(**extra) -> dict:
    import torch

    model = ""
    if Path("/proc/cpuinfo").exists():
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    info = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model or platform.processor(), "platform": platform.platform(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "load_avg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    info.update(extra)
    return info


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table; the first column left-aligned, the others right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console(width=max(120, Console().width)).print(table)


def _jsonable(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # strict JSON: NaN / inf become null
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(path: Path, result: dict, quiet: bool = False) -> None:
    """Written to a temp file and renamed: a process killed while writing leaves the previous version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=1))
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


def replot(out: Path, plot) -> dict:
    """`--replot`: redraw <out>.png from the saved <out> JSON without measuring."""
    result = json.loads(Path(out).read_text())
    plot(result, Path(out).with_suffix(".png"))
    return result


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def run_child_points(script: str, spec: dict, label=lambda row: f"T={row['seq_len']:6d}") -> list[dict]:
    """Run `script --child <spec>` in a fresh process (its own thread count and malloc settings, so
    peak memory is this point's alone) and collect the `RESULT {json}` lines it prints, each shown
    as it lands with `label(row)`. Raises with the child's stderr when it fails."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen([sys.executable, str(Path(script).resolve()), "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rows = []
    for line in proc.stdout:  # streamed: each point is printed as it lands
        if line.startswith("RESULT "):
            row = {"shape": spec["shape_name"], "method": spec["method"], **json.loads(line[len("RESULT "):])}
            rows.append(row)
            if row["status"] == "ok":
                print(f"  {row['shape']} {row['method']:5s} {label(row)}: {row['time_s']:7.2f} s, "
                      f"peak +{fmt_bytes(row['peak_delta'])}", flush=True)
            else:
                print(f"  {row['shape']} {row['method']:5s} T={row['seq_len']:6d}: skipped ({row['why']})", flush=True)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"child {spec['shape_name']}/{spec['method']} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return rows
