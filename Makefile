# nanoserve — set-up and everyday commands.  `make demo` and `make test` are all a
# newcomer needs: each creates the virtualenv in .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.nanoserve-installed
# CI pins these; they are on the local disk of the dev/CI machines (CPU build).
# A GPU user installs a CUDA torch into .venv first (see README); it is then kept.
TORCH_PIN ?= torch==2.13.0 triton==3.8.0
NBVAL  := --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-current-env

.PHONY: install demo test test-fast lint notebooks bench exercises clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test]' -c constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/nanoserve generate --model demo --prompt "ROMEO:" --max-tokens 120 --temperature 0.8 --top-k 40 --seed 0

# The test command the README documents and .ci/run calls.
test: $(STAMP)
	$(BIN)/ruff check nanoserve kernels tests benchmarks exercises
	$(BIN)/pytest -q tests
	$(BIN)/pytest -q tests/exercises --impl exercises --expect-stubs
	$(BIN)/pytest -q $(NBVAL) notebooks

test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check nanoserve kernels tests benchmarks exercises

# Re-execute every notebook in place (what is committed must be executed top to bottom).
notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

# Your solutions in exercises/ against the exercise tests: `make exercises`, or one: `make exercises EX=ex04`.
EX ?=
exercises: $(STAMP)
	$(BIN)/pytest tests/exercises --impl exercises -q --no-header --tb=short -p no:cacheprovider $(if $(EX),-m $(EX))

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
