# The two commands of the README. Both install what they need (as root, on a fresh machine).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
APT_PACKAGES := runc crun erofs-utils mmdebstrap debootstrap btrfs-progs nftables iproute2 \
                busybox-static uidmap gcc libc6-dev ca-certificates tar gzip
# what only the tests need: a real Prometheus, the dashboard's browser, tmux for `corral top`,
# QEMU for the microVM backend, and the distributed filesystem the shared-store tests and the
# ondemand bench run the layer store on (corral/bench/dfs.py)
TEST_APT_PACKAGES := prometheus chromium tmux qemu-system-x86 \
                     moosefs-master moosefs-chunkserver moosefs-client
PYTEST_ARGS ?=

.PHONY: demo test lint gen deps test-deps venv bench clean-node

demo: venv
	$(VENV)/bin/corral demo

test: venv test-deps
	$(PY) -m pytest $(PYTEST_ARGS)

test-deps: venv $(VENV)/.installed-ui
	@$(MAKE) --no-print-directory deps APT_PACKAGES="$(TEST_APT_PACKAGES)"

$(VENV)/.installed-ui: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev,ui,cluster,e2b,swerex]'
	touch $@


lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy src/corral

# Regenerate the blocking SDK (src/corral/sdk/_sync_gen.py) from the async handles.
gen: venv
	$(PY) -m corral.sdk._gen_sync

deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

venv: deps $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

bench: venv
	$(VENV)/bin/corral bench --help

clean-node: venv
	$(VENV)/bin/corral node gc --all
