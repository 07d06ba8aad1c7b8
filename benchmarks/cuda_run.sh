#!/usr/bin/env bash
# One batched run on a CUDA machine (the device tool's `run`, carrying .whl and .gpu):
#   CUDA tests (tinygemm/int8pack QuantLinear, Triton attention natively, bench on CUDA),
#   benchmarks/attention.py, and `edgellm bench` on a random-weight SmolLM2-135M-shaped model.
# Results land in $OUT (or benchmarks/results/cuda when OUT is unset).
set -uo pipefail
OUT=${OUT:-benchmarks/results/cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_linear.py tests/test_triton_attention.py \
  tests/test_attention.py tests/test_kv_cache.py -k "not bundled" 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 90 python3 benchmarks/attention.py --out "$OUT/attention-cuda.json" 2>&1 | tail -25
PROMPT=${PROMPT:-/usr/share/common-licenses/GPL-3}
[ -f "$PROMPT" ] || PROMPT=.gpu/GPL-3
python3 benchmarks/random_model.py /tmp/rnd135 --tokenizer .gpu/tok >/dev/null
timeout 120 python3 -m edgellm.cli bench -m /tmp/rnd135 --device cuda --weights fp,int8,int4 -p 512 -n 128 -r 3 \
  --prompt-file "$PROMPT" --no-progress --json "$OUT/bench-cuda-weights.json" --note "random weights, SmolLM2-135M shape" 2>&1 | tail -8
timeout 120 python3 -m edgellm.cli bench -m /tmp/rnd135 --device cuda --kv fp,int8,int4 --ctx 256,6144 -n 64 -r 2 \
  --prompt-file "$PROMPT" --no-progress --json "$OUT/bench-cuda-kv.json" --note "random weights, SmolLM2-135M shape" 2>&1 | tail -10
