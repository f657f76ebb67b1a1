# omniroll: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(PY):
	python3 -m venv $(VENV)

# torch==2.13.0 first: an unpinned torch could pull a multi-GB CUDA build on a CPU box.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/omniroll demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/prefix_sharing.py
	$(PY) benchmarks/agent_loop_overhead.py
	$(PY) benchmarks/weight_sync.py

clean:
	rm -rf $(VENV) .omniroll_cache
