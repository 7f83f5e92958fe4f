# Two commands do all set-up on a fresh Debian machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get

.PHONY: demo test lint bench haproxy chromium promtool venv test-deps clean

haproxy:
	@command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || \
	  { $(APT) update -qq && $(APT) install -y -qq haproxy >/dev/null; }
	@PATH="$$PATH:/usr/sbin" haproxy -v | head -1

# Debian's Chromium, for the status page's browser test.
chromium:
	@command -v chromium >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq chromium >/dev/null; }

# promtool from Debian's `prometheus` package, for the alert rules' tests: only the tool is
# unpacked (installing the package would start a Prometheus server on the machine).
promtool:
	@command -v promtool >/dev/null || { tmp=$$(mktemp -d) && chmod 755 $$tmp && cd $$tmp && \
	  { apt-get download prometheus >/dev/null 2>&1 || { $(APT) update -qq && apt-get download prometheus >/dev/null; }; } && \
	  dpkg-deb -x prometheus_*.deb unpacked && $(SUDO) install -m 755 unpacked/usr/bin/promtool /usr/local/bin/promtool; \
	  status=$$?; rm -rf $$tmp; exit $$status; }
	@promtool --version | head -1

$(BIN)/haproxy-supervisor: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@touch $@

venv: $(BIN)/haproxy-supervisor

$(VENV)/.test-deps: $(BIN)/haproxy-supervisor
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

test-deps: haproxy chromium promtool $(VENV)/.test-deps

test: test-deps
	PATH="$$PATH:/usr/sbin" $(BIN)/ruff check supervisor tests bench
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m pytest -q

lint: $(VENV)/.test-deps
	$(BIN)/ruff check supervisor tests bench

bench: haproxy venv
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m bench

demo: haproxy venv
	PATH="$$PATH:/usr/sbin" $(BIN)/python demo/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache demo/run
