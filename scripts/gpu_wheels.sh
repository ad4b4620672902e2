#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels that benchmarks/gpu_e2e.py needs on the bare H200
# image: sglang 0.5.23 and the pure-Python packages it imports that the image lacks, pinned in
# benchmarks/gpu_wheels.txt. cp312 manylinux wheels, no dependencies resolved (the list is
# complete: tests/benchmarks/test_gpu_path.py imports SGLang's CUDA path, and tries the imports
# inside the functions its engines run, with only the image's packages and these). The device
# machine has no network: the run carries .whl and installs it with `pip install --no-index
# --no-deps --target` (the two commands: docs/PERFORMANCE.md section 7).
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=benchmarks/gpu_wheels.txt
mapfile -t PINS < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$LIST" | awk '{print $1}')
# antlr4-python3-runtime (omegaconf's) is published as an sdist only: its pure-Python wheel is built here
SDIST=() BIN=()
for pin in "${PINS[@]}"; do case "$pin" in antlr4-python3-runtime==*) SDIST+=("$pin") ;; *) BIN+=("$pin") ;; esac; done
rm -rf .whl && mkdir -p .whl  # one version of each: a stale second one stops the whole install there
# manylinux_2_34: the sglang wheel needs glibc 2.34; pip matches each platform tag exactly.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${BIN[@]}"
[ "${#SDIST[@]}" -eq 0 ] || python3 -m pip wheel -q --no-deps -w .whl "${SDIST[@]}"
count=$(ls .whl/*.whl | wc -l)
[ "$count" -eq "${#PINS[@]}" ] || { echo "expected ${#PINS[@]} wheels, got $count" >&2; exit 1; }
du -b .whl/*.whl | sort -rn | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2; t += $1}
  END {printf "%8.2f MiB  total (%d wheels)\n", t / 1048576, NR}'
