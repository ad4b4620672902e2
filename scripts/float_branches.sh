#!/usr/bin/env bash
# The float-sensitive unit tests (their references, ties, bitwise comparisons) under every GEMM path
# this CPU offers: MKL's code branches (MKL_CBWR), ATen's kernels (ATEN_CPU_CAPABILITY) and thread
# counts. A test that passes on one path and fails on another compares floats more tightly than the
# arithmetic promises (docs/TESTING.md, "Bitwise float comparisons"). Usage:
#   bash scripts/float_branches.sh [pytest args...]   (default: the list below)
# Prints one line per setting: the setting, pytest's summary line.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TESTS=(tests/train/test_vocab_parallel.py tests/draft/test_draft.py tests/draft/test_dflash.py
       tests/draft/test_eagle3_mla.py tests/draft/test_dflash_attention.py tests/draft/test_ttt_attention.py
       tests/draft/test_dflash_export.py tests/draft/test_dflash_replay.py tests/export/test_export_eagle31.py
       tests/train/test_optim.py tests/train/test_host_embedding.py)
[ $# -gt 0 ] && TESTS=("$@")
"$PY" -c "import torch; print('torch', torch.__version__, '| BLAS:', torch.backends.mkl.is_available() and 'MKL' or 'not MKL', '| ATen CPU capability:', torch.backends.cpu.get_cpu_capability())"
SETTINGS=(MKL_CBWR=AUTO MKL_CBWR=COMPATIBLE MKL_CBWR=SSE4_2 MKL_CBWR=AVX2 MKL_CBWR=AVX512
          ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1)
for setting in "${SETTINGS[@]}"; do
    summary=$(env $setting "$PY" -m pytest -q -n 0 -p no:cacheprovider -m "not engine and not e2e" \
              "${TESTS[@]}" 2>&1 | grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" | tr '\n' ' ')
    echo "$setting: $summary"
done
