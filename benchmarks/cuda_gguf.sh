#!/usr/bin/env bash
# GGUF files as stored on CUDA, one batched run on the device machine (the device tool's `run`, carrying .whl and
# .gpu): tests/test_triton_gguf.py compiled on the GPU, benchmarks/triton_gguf_kernels.py, and `edgellm bench` on
# GGUFs grown from the skeletons in .gpu (benchmarks/gguf_skeleton.py: the local test files' shapes and type mixes,
# random blocks) with the Triton kernels (the default), the 1B Q4_K_M also with EDGELLM_GGUF_TRITON=0 (every product
# dequantized by torch ops, the path before them) and beside a bf16 model of its shape (--weights fp).
# .gpu holds the *.skel.gguf files, tok/ (the bundled tokenizer as tokenizer.json) and GPL-3; .whl the wheels the
# image lacks (gguf, platformdirs). Results land in $OUT (or benchmarks/results/cuda-gguf when OUT is unset).
# STAGES picks parts: tests,bench1b,kernels,files
set -uo pipefail
OUT=${OUT:-benchmarks/results/cuda-gguf}
STAGES=${STAGES:-tests,bench1b,kernels,files}
source benchmarks/device_setup.sh
has() { [[ ",$STAGES," == *",$1,"* ]]; }

grow() { [ -f "/tmp/$1.gguf" ] || python3 benchmarks/gguf_skeleton.py grow ".gpu/$1.skel.gguf" "/tmp/$1.gguf"; }
( grow random1b.Q4_K_M; [ -d /tmp/rnd1b ] || python3 benchmarks/random_model.py /tmp/rnd1b --shape llama-3.2-1b \
  --tokenizer .gpu/tok ) > /tmp/grow.log 2>&1 &
GROW=$!
if has tests; then
  TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 16 tests/test_triton_gguf.py 2>&1 \
    | tail -12 | tee "$OUT/tests.txt"
fi
wait $GROW; tail -2 /tmp/grow.log

BENCH=(python3 -m edgellm.cli bench --device cuda --prompt-file .gpu/GPL-3 --no-progress)
# every bench's JSON goes to /tmp/bench, merged after each into one file of $OUT (the device tool returns 8 files)
mkdir -p /tmp/bench
merge() {
  python3 - "$OUT/cuda-gguf-bench.json" /tmp/bench/*.json <<'PY'
import json, sys
from pathlib import Path
Path(sys.argv[1]).write_text(json.dumps({Path(f).stem: json.loads(Path(f).read_text()) for f in sys.argv[2:]}, indent=1))
PY
}
NOTE="random blocks in the shape and type mix of the local test file (benchmarks/gguf_skeleton.py)"
if has bench1b; then
  timeout 60 "${BENCH[@]}" -m /tmp/random1b.Q4_K_M.gguf -p 512 -n 128 -r 3 --json "/tmp/bench/bench-random1b.Q4_K_M.json" \
    --note "$NOTE; Triton GGUF kernels; CUDA-graph decode step" 2>&1 | tail -4; merge
  EDGELLM_GGUF_TRITON=0 timeout 60 "${BENCH[@]}" -m /tmp/random1b.Q4_K_M.gguf -p 512 -n 32 -r 1 \
    --json "/tmp/bench/bench-random1b.Q4_K_M-torchops.json" --note "$NOTE; EDGELLM_GGUF_TRITON=0 (torch ops); CUDA graph" \
    2>&1 | tail -4; merge
  timeout 60 "${BENCH[@]}" -m /tmp/rnd1b -p 512 -n 128 -r 3 --weights fp \
    --json "/tmp/bench/bench-rnd1b-bf16.json" --note "random weights, Llama-3.2-1B shape, bf16 safetensors" 2>&1 | tail -4; merge
fi
if has files; then
  for f in randomqwen05.Q4_K_M SmolLM2-135M-Instruct.Q4_K_M random1b.Q8_0 random1b.Q4_0; do
    grow $f > /dev/null
    timeout 45 "${BENCH[@]}" -m "/tmp/$f.gguf" -p 512 -n 128 -r 3 --json "/tmp/bench/bench-$f.json" \
      --note "$NOTE; Triton GGUF kernels; CUDA-graph decode step" 2>&1 | tail -3; merge
  done
  timeout 45 "${BENCH[@]}" -m /tmp/random1b.Q4_K_M.gguf -p 512 -n 128 -r 3 --compile off \
    --json "/tmp/bench/bench-random1b.Q4_K_M-eager.json" --note "$NOTE; Triton GGUF kernels; --compile off" 2>&1 | tail -3; merge
fi
if has kernels; then
  timeout 100 python3 benchmarks/triton_gguf_kernels.py --json "$OUT/triton-gguf-kernels.json" > "$OUT/kernels.log" 2>&1
  grep -v '^{' "$OUT/kernels.log" | tail -3
fi
