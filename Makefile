# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Both create the virtualenv and install the package when it is missing or out of date.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
# The CPU torch build is pinned here (not in pyproject.toml) so GPU users keep their own build.
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt
# Quiet the harmless "Location ... is ignored" notices of this machine's pip configuration.
PIP_FILTER := { grep -v "is ignored: it is neither" || true; }

.PHONY: demo test lint install docs clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev]' 2>&1 | $(PIP_FILTER)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamrl demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check streamrl tests examples notebooks benchmarks
	$(VENV)/bin/ruff format --check streamrl tests examples notebooks benchmarks

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The docs site (mkdocs.yml): any warning, such as a broken link or a malformed docstring, fails.
# NO_MKDOCS_2_WARNING quiets Material's notice about its own future, which is not about our docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
