#!/usr/bin/env bash
# One batched run on a CUDA machine (the device tool's `run`, carrying .whl and .gpu):
#   CUDA tests (tinygemm/int8pack QuantLinear, Triton attention natively, the CUDA-graph decode step),
#   benchmarks/attention.py, and `edgellm bench` on random-weight models of real shapes: weight formats
#   with the CUDA-graph decode step and with --no-compile, KV formats across contexts, drafts.
# .gpu holds tok/ (the bundled tokenizer as tokenizer.json) and GPL-3; .whl the wheels the image lacks (gguf).
# Results land in $OUT (or benchmarks/results/cuda when OUT is unset). STAGES picks parts: tests,attention,bench,big
set -uo pipefail
OUT=${OUT:-benchmarks/results/cuda}
STAGES=${STAGES:-tests,attention,bench,big}
source benchmarks/device_setup.sh
has() { [[ ",$STAGES," == *",$1,"* ]]; }
PROMPT=${PROMPT:-/usr/share/common-licenses/GPL-3}
[ -f "$PROMPT" ] || PROMPT=.gpu/GPL-3
BENCH=(python3 -m edgellm.cli bench --device cuda --prompt-file "$PROMPT" --no-progress)

if has tests; then
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant_linear.py \
    tests/test_triton_attention.py tests/test_attention.py tests/test_kv_cache.py tests/test_decode_step.py \
    -k "not bundled" 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
if has attention; then
  timeout 90 python3 benchmarks/attention.py --out "$OUT/attention-cuda.json" 2>&1 | tail -25
fi
if has bench; then
  python3 benchmarks/random_model.py /tmp/rnd135 --tokenizer .gpu/tok >/dev/null
  NOTE="random weights, SmolLM2-135M shape, bf16"
  timeout 150 "${BENCH[@]}" -m /tmp/rnd135 --weights fp,int8,int4 -p 512 -n 128 -r 3 \
    --json "$OUT/bench-cuda-weights.json" --note "$NOTE; CUDA-graph decode step" 2>&1 | tail -8
  timeout 120 "${BENCH[@]}" -m /tmp/rnd135 --weights fp,int8,int4 -p 512 -n 128 -r 3 --compile off \
    --json "$OUT/bench-cuda-weights-eager.json" --note "$NOTE; --compile off (eager decode step)" 2>&1 | tail -8
  timeout 200 "${BENCH[@]}" -m /tmp/rnd135 --weights fp,int4 -p 512 -n 128 -r 3 --compile inductor \
    --json "$OUT/bench-cuda-weights-inductor.json" --note "$NOTE; --compile inductor" 2>&1 | tail -6
  timeout 150 "${BENCH[@]}" -m /tmp/rnd135 --kv fp,int8,int4 --ctx 256,6144 -n 64 -r 2 \
    --json "$OUT/bench-cuda-kv.json" --note "$NOTE; CUDA-graph decode step" 2>&1 | tail -10
fi
if has big; then
  python3 benchmarks/random_model.py /tmp/rnd1b --shape llama-3.2-1b --tokenizer .gpu/tok >/dev/null
  timeout 150 "${BENCH[@]}" -m /tmp/rnd1b --weights fp,int4 -p 512 -n 128 -r 3 --draft none,self \
    --json "$OUT/bench-cuda-1b.json" --note "random weights, Llama-3.2-1B shape, bf16; CUDA-graph decode step" 2>&1 | tail -8
fi
