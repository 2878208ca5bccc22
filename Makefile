# nanoserve — set-up and everyday commands.  `make demo` and `make test` are all a
# newcomer needs: each creates the virtualenv in .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.nanoserve-installed
RUNTIME := $(VENV)/.nanoserve-runtime
# CI pins these; they are on the local disk of the dev/CI machines (CPU build).
# A GPU user installs a CUDA torch into .venv first (see README); it is then kept.
TORCH_PIN ?= torch==2.13.0 triton==3.8.0
NBVAL  := --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-current-env

.PHONY: install demo hint test test-triton-latest test-clients test-fast lint core-size notebooks bench gpu-check exercises clean

install: $(STAMP)

# What the engine needs and nothing else: enough for `make demo`.
$(RUNTIME): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e . -c constraints.txt
	touch $(RUNTIME)

# The test extras on top: Jupyter, transformers, peft, the server, llguidance.
$(STAMP): $(RUNTIME)
	$(BIN)/pip install -q -e '.[test]' -c constraints.txt
	touch $(STAMP)

demo: $(RUNTIME)
	$(BIN)/nanoserve generate --model demo --prompt "ROMEO:" --max-tokens 120 --temperature 0.8 --top-k 40 --seed 0

# The test command the README documents and .ci/run calls.
test: $(STAMP)
	$(BIN)/ruff check nanoserve kernels tests benchmarks exercises scripts
	@echo "tests on triton $$($(TRITON_VERSION)) (the pinned one)"
	$(BIN)/pytest -q tests
	@$(MAKE) --no-print-directory test-triton-latest
	@$(MAKE) --no-print-directory test-clients
	$(BIN)/pytest -q tests/exercises --impl exercises --expect-stubs
	$(BIN)/pytest -q $(NBVAL) notebooks

# The kernel tests once more on the newest triton the package index offers (pyproject allows triton ≥ 3.4),
# installed beside the pinned one into .triton-latest. When that is the pinned version, or no index
# answers (CI may be offline), one line says so and nothing fails.
KERNEL_TESTS := tests/test_kernels_paged.py tests/test_kernels_flash.py tests/test_kernels_flash_tree.py tests/test_kernels_dequant.py \
	tests/test_kernels_configs.py \
	tests/test_kernels_kv_quant.py tests/test_kv_int4.py tests/test_kernels_int8.py tests/test_kernels_ggml.py \
	tests/test_kernels_lut_gemv.py tests/test_kernels_mla_decode.py \
	tests/test_attention_backend.py tests/exercises/test_ex07_flash_attention.py tests/exercises/test_ex11_int4_unpack.py
TRITON_LATEST  := .triton-latest
TRITON_VERSION := $(BIN)/python -c "import triton; print(triton.__version__)"
PIP_NO_WAIT    := --no-deps --timeout 20 --retries 1

test-triton-latest: $(STAMP)
	@pinned=$$($(TRITON_VERSION)); \
	out=$$($(BIN)/pip install --dry-run --ignore-installed $(PIP_NO_WAIT) triton 2>&1); \
	newest=$$(echo "$$out" | sed -n 's/^Would install triton-//p'); \
	if [ -z "$$newest" ]; then \
	  echo "newest-triton kernel tests skipped: pip found no triton ($$(echo "$$out" | grep -m1 ERROR))"; \
	elif [ "$$newest" = "$$pinned" ]; then \
	  echo "newest-triton kernel tests skipped: the newest triton the index offers is the pinned $$pinned"; \
	else \
	  [ -d $(TRITON_LATEST)/triton-$$newest.dist-info ] || \
	    $(BIN)/pip install -q --upgrade --target $(TRITON_LATEST) $(PIP_NO_WAIT) triton==$$newest || \
	    { echo "newest-triton kernel tests skipped: pip could not install triton $$newest"; exit 0; }; \
	  echo "kernel tests on triton $$newest (the newest; pinned: $$pinned)"; \
	  PYTHONPATH=$(CURDIR)/$(TRITON_LATEST) $(BIN)/pytest -q $(KERNEL_TESTS); \
	fi

# Real client libraries against the server (tests/test_clients.py): lm-evaluation-harness, LangChain, LiteLLM;
# and compressed-tensors against our checkpoint reader and writer (tests/test_compressed_tensors.py).
# Not dependencies of nanoserve: they go into .venv-clients, a virtualenv that also sees .venv's packages (one
# .pth line), so torch and nanoserve are not installed twice. When no index answers, one line says so.
CLIENTS     := .venv-clients
CLIENT_PKGS := lm-eval[hf,api] langchain-openai litellm

test-clients: $(STAMP)
	@test -x $(CLIENTS)/bin/python || $(PYTHON) -m venv $(CLIENTS)
	@echo "import site; site.addsitedir('$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')')" \
	  > "$$($(CLIENTS)/bin/python -c 'import site; print(site.getsitepackages()[0])')/nanoserve-venv.pth"
	@if $(CLIENTS)/bin/pip install -q --timeout 20 --retries 1 $(CLIENT_PKGS) -c constraints.txt; then \
	  echo "client-library tests (lm-eval, langchain-openai, litellm) in $(CLIENTS)"; \
	  LITELLM_LOCAL_MODEL_COST_MAP=True HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(CLIENTS)/bin/python -P -c \
	    "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_clients.py']))"; \
	else echo "client-library tests skipped: pip could not install $(CLIENT_PKGS)"; fi
	@if $(CLIENTS)/bin/pip install -q --timeout 20 --retries 1 compressed-tensors -c constraints.txt; then \
	  echo "compressed-tensors checkpoints (the library's own, and ours in transformers) in $(CLIENTS)"; \
	  HF_HUB_OFFLINE=1 $(CLIENTS)/bin/python -P -c \
	    "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_compressed_tensors.py']))"; \
	else echo "compressed-tensors tests skipped: pip could not install compressed-tensors"; fi

test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check nanoserve kernels tests benchmarks exercises scripts

# The core's files in reading order with their lines, and the share the extensions hold.
core-size: $(STAMP)
	$(BIN)/python scripts/core_size.py

# Re-execute every notebook in place (what is committed must be executed top to bottom).
notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

# One level of an exercise's hints (1 the idea, 2 the shape, 3 nearly the code): `make hint EX=ex04 N=2`.
N ?= 1
PART ?=
hint:
	@$(PYTHON) scripts/hint.py $(EX) $(N) $(PART)

# Your solutions in exercises/ against the exercise tests: `make exercises`, or one: `make exercises EX=ex04`.
EX ?=
exercises: $(STAMP)
	$(BIN)/pytest tests/exercises --impl exercises -q --no-header --tb=short -p no:cacheprovider $(if $(EX),-m $(EX))

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_decode.py

# Every GPU figure in one run (<= 20 min on one H100 / H200, offline): benchmarks/gpu_check.json and a table
# per figure. Installs nothing: it runs .venv's Python when there is one, else python3; a PYTHON you set wins
# (a GPU image with the project pip-installed: `PYTHON=python3 make gpu-check`). Options: `make gpu-check
# ARGS="--only b,e"`, `ARGS=--dry-run` (CPU, tiny shapes: checks the script), `ARGS="--preset roofline"`
# (issue 43's figures c, d, e, g, h, j in <= 8 min: a short lease). = `python benchmarks/gpu_check.py`.
ARGS ?=
GPU_PYTHON ?= $(if $(and $(filter file,$(origin PYTHON)),$(wildcard $(BIN)/python)),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(TRITON_LATEST)
