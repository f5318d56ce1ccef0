# remote_gpu.trainer: the two commands of the README (`make demo`, `make test`) and the steps behind them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BUILD := .build
COLLECTIONS := $(abspath $(BUILD)/collections)
COLLECTION_LINK := $(BUILD)/collections/ansible_collections/remote_gpu/trainer
FAKEGPU := $(BUILD)/fakegpu
SANITY_TREE := $(BUILD)/sanity/ansible_collections/remote_gpu/trainer
DEMO_STATE := $(BUILD)/demo-fleet
SYSTEM_TOOLS := sshd:openssh-server ssh:openssh-client nc:netcat-openbsd rsync:rsync gcc:gcc tmux:tmux crontab:cron
export ANSIBLE_COLLECTIONS_PATH := $(COLLECTIONS)
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_NOCOLOR := 1

.PHONY: help demo test system-deps venv collection simulator lint ruff yamllint ansible-lint role-specs \
	sanity units simulator-tests fleet-tests molecule build-check bench clean

help:
	@echo "make demo   bring up 3 simulated GPU boxes, run the collection against them, tear them down"
	@echo "make test   lint, ansible-test sanity, unit, simulator, fleet and Molecule tests"
	@echo "make bench  the collection against the seed scripts and plain tools (not part of make test; see benchmarks/)"

## Environment ---------------------------------------------------------------------------------------------

system-deps:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v "$${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/$${pair%%:*}" ] || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install:$$missing" >&2; exit 1; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(BIN)/.installed: requirements-dev.txt requirements-dev.lock
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run make PYTHON=python3" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt -c requirements-dev.lock
	touch $@

venv: $(BIN)/.installed

collection:
	@mkdir -p $(dir $(COLLECTION_LINK))
	@ln -sfn $(CURDIR) $(COLLECTION_LINK)

simulator: venv system-deps
	$(BIN)/python tests/fakegpu/build.py build --out $(FAKEGPU)

## Tests ---------------------------------------------------------------------------------------------------

test: venv system-deps collection simulator lint sanity units simulator-tests fleet-tests build-check molecule
	@echo "make test: all steps passed"

lint: ruff yamllint ansible-lint role-specs

ruff: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

yamllint: venv
	$(BIN)/yamllint --strict .

ansible-lint: venv collection
	$(BIN)/ansible-lint --offline -q

role-specs: venv
	$(BIN)/python tests/lint/check_role_specs.py roles

# ansible-test needs the collection at ansible_collections/<ns>/<name>; it gets a copy of the files git would ship.
sanity: venv
	rm -rf $(BUILD)/sanity && mkdir -p $(SANITY_TREE)
	git ls-files -z --cached --others --exclude-standard | rsync -a --from0 --files-from=- ./ $(SANITY_TREE)/
	cd $(SANITY_TREE) && git init -q && git add -A  # else ansible-test asks the enclosing repo, which ignores .build
	mkdir -p ~/.ansible/test/cache
	cp tests/sanity/get_pip_standin.py ~/.ansible/test/cache/get_pip_24_2.py
	cd $(SANITY_TREE) && $(abspath $(BIN))/ansible-test sanity --venv --python 3.11 --color no

units: venv collection
	$(BIN)/pytest -q tests/unit

simulator-tests: venv collection simulator
	$(BIN)/pytest -q tests/fakegpu/tests

fleet-tests: venv collection simulator
	$(BIN)/pytest -q tests/fleet/tests

# Every Molecule scenario under extensions/molecule (shared/ holds their common playbooks, default/ is a stub).
molecule: venv collection simulator
	@for dir in extensions/molecule/*/; do \
	  scenario=$$(basename "$$dir"); case "$$scenario" in shared|default) continue;; esac; \
	  [ -f "$$dir/molecule.yml" ] || continue; \
	  echo "== molecule test -s $$scenario"; \
	  (cd extensions && molecule test -s "$$scenario") || exit 1; \
	done

# The built tarball installs, and ansible-doc documents every module and filter from the installed copy.
build-check: venv
	rm -rf $(BUILD)/dist $(BUILD)/installed && mkdir -p $(BUILD)/dist
	$(BIN)/ansible-galaxy collection build --force --output-path $(BUILD)/dist >/dev/null
	$(BIN)/ansible-galaxy collection install --force -p $(BUILD)/installed $(BUILD)/dist/remote_gpu-trainer-*.tar.gz >/dev/null
	@for plugin in plugins/modules/*.py; do \
	  name=$$(basename "$$plugin" .py); \
	  ANSIBLE_COLLECTIONS_PATH=$(abspath $(BUILD)/installed) $(BIN)/ansible-doc remote_gpu.trainer.$$name >/dev/null || exit 1; \
	  echo "ansible-doc module remote_gpu.trainer.$$name: ok"; \
	done
	@for doc in plugins/filter/*.yml; do \
	  [ -e "$$doc" ] || continue; name=$$(basename "$$doc" .yml); \
	  ANSIBLE_COLLECTIONS_PATH=$(abspath $(BUILD)/installed) $(BIN)/ansible-doc -t filter remote_gpu.trainer.$$name >/dev/null || exit 1; \
	  echo "ansible-doc filter remote_gpu.trainer.$$name: ok"; \
	done

## Benchmarks (not part of make test: timings belong in benchmarks, not in assertions) ---------------------

bench: venv system-deps collection simulator
	$(BIN)/python benchmarks/bench.py

## Demo ----------------------------------------------------------------------------------------------------

demo: venv system-deps collection simulator
	$(BIN)/python tests/demo.py --state-dir $(DEMO_STATE)

clean:
	-$(BIN)/python tests/fleet/fleet.py down --all 2>/dev/null
	rm -rf $(BUILD) tests/output
