"""Co-located step time with and without CUDA MPS: a step of benchmarks/gpu_check.py for a lent machine
with several GPUs (docs/ARCHITECTURE.md's co-located layout: a trainer rank and a TP rank share each GPU,
and MPS lets their kernels run side by side).

With fewer than two GPUs (or none) it skips, saying so (exit 3, gpu_check.py's SKIP_EXIT). With several
it is a placeholder: the measurement (benchmarks/gpu_cli.py's co-located run at hw.target_tp=2, once
plain and once under `nvidia-cuda-mps-control -d`, step time from each summary) is not written yet, and
the step fails saying that, so a multi-GPU run cannot pass without it.
"""
from __future__ import annotations

import sys


def main() -> int:
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as err:  # noqa: BLE001 - a broken CUDA install is a reason to skip, said in full
        print(f"SKIP MPS: torch.cuda unavailable ({type(err).__name__}: {err})", flush=True)
        return 3
    if gpus < 2:
        print(f"SKIP MPS: {gpus} GPU(s); MPS on/off for co-located layouts needs a multi-GPU machine", flush=True)
        return 3
    print(f"FAIL MPS: {gpus} GPUs lent, but the MPS measurement is a placeholder (benchmarks/gpu_mps.py)", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
