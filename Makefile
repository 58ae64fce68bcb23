# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# torch first and pinned: an unpinned torch drags in gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[dev]'
	touch $@

# Debian packages the test-suite needs (only when run as root; otherwise they must be present).
SYSTEM_PACKAGES := g++ make slurm-wlm munge
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi

demo: install
	$(PY) -m megaroute.demo

test: install system-deps
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs *.egg-info data/prepared
