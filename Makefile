# Two commands: `make demo` and `make test`. Each sets up .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-kernels setup clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,examples]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipetrain.cli demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist loadfile

# The everyday path: every test but those marked slow (CI runs `make test`, all of them).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist loadfile -m "not slow"

# The exactness tests under each kernel path a CPU can be held to, below its own: a tolerance that holds on one
# machine's BLAS and vector kernels only is tuned, not derived. A path this CPU lacks runs as its best one, so
# run it on an AVX-512 machine to cover all three. Each line: ATen's, MKL's and oneDNN's instruction sets.
KERNEL_PATHS := \
	"ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41" \
	"ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" \
	"ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX"

test-kernels: $(STAMP)
	@failed=; for path in $(KERNEL_PATHS); do \
		echo "== $$path"; \
		env $$path $(BIN)/python -c "import torch; print('ATen kernels:', torch.backends.cpu.get_cpu_capability())"; \
		env $$path $(BIN)/python -m pytest -q -n 4 --dist loadfile -m exact || failed="$$failed\n  $$path"; \
	done; if [ -n "$$failed" ]; then printf "exactness failed under:$$failed\n"; exit 1; fi

clean:
	rm -rf $(VENV) runs
