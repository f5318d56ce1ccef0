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
COLLECTION_DIR := ansible_collections/remote_gpu/trainer
# The newest ansible-core of the version matrix (`make compat`), in its own venv on a controller Python >= 3.12.
COMPAT_CORE := 2.21
COMPAT_PYTHONS := 3.13 3.12
COMPAT_VENV := $(BUILD)/compat/ansible-$(COMPAT_CORE)
COMPAT_BIN := $(COMPAT_VENV)/bin
# Set before .venv/bin joins PATH: none of the main venv's tools leak into the compat runs.
COMPAT_PATH := $(abspath $(COMPAT_BIN)):$(PATH)
COMPAT_SCENARIO ?= box_python
DEMO_STATE := $(BUILD)/demo-fleet
SYSTEM_TOOLS := sshd:openssh-server ssh:openssh-client nc:netcat-openbsd rsync:rsync gcc:gcc tmux:tmux crontab:cron chromium:chromium chromedriver:chromium-driver \
	shellcheck:shellcheck
export ANSIBLE_COLLECTIONS_PATH := $(COLLECTIONS)
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_NOCOLOR := 1

.PHONY: help demo test system-deps venv collection simulator lint ruff yamllint ansible-lint role-specs \
	sanity units simulator-tests fleet-tests browser-tests molecule build-check bench clean \
	compat compat-venv compat-sanity compat-units compat-molecule

help:
	@echo "make demo   bring up 3 simulated GPU boxes, run the collection against them, tear them down"
	@echo "make test   lint, ansible-test sanity, unit, simulator, fleet and Molecule tests"
	@echo "make bench  the collection against the seed scripts and plain tools (not part of make test; see benchmarks/)"
	@echo "make compat sanity, unit tests and one Molecule scenario under the newest ansible-core ($(COMPAT_CORE))"

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

# ansible-core $(COMPAT_CORE) needs a newer controller Python than the main venv's: the first of COMPAT_PYTHONS found.
$(COMPAT_BIN)/.installed: requirements-compat.txt requirements-compat.lock
	python=$$(python3 tests/compat/pythons.py find $(COMPAT_PYTHONS)) && rm -rf $(COMPAT_VENV) && "$$python" -m venv $(COMPAT_VENV)
	$(COMPAT_BIN)/pip install -q --disable-pip-version-check -r requirements-compat.txt -c requirements-compat.lock
	touch $@

compat-venv: $(COMPAT_BIN)/.installed

collection:
	@mkdir -p $(dir $(COLLECTION_LINK))
	@ln -sfn $(CURDIR) $(COLLECTION_LINK)

simulator: venv system-deps
	$(BIN)/python tests/fakegpu/build.py build --out $(FAKEGPU)

## Tests ---------------------------------------------------------------------------------------------------

test: venv system-deps collection simulator lint sanity units simulator-tests fleet-tests browser-tests build-check \
	docs-lint changelog-lint ee-check molecule
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

# $(call sanity-with,BIN,ROOT): ansible-test sanity of that venv, on its own Python, over a copy of the files git
# would ship at ROOT/ansible_collections/<ns>/<name> (where ansible-test wants them). Its get-pip bootstrap comes from
# a host this network cannot reach: our stand-in goes into its cache under the pip version that ansible-test pins.
PY_XY := import sys; print("%d.%d" % sys.version_info[:2])
PY_TEST_PIP := import types; from ansible_test._internal.python_requirements import get_venv_packages as g; \
	print(g(types.SimpleNamespace(version="")).get("pip").replace(".", "_"))
define sanity-with
rm -rf $(2) && mkdir -p $(2)/$(COLLECTION_DIR)
git ls-files -z --cached --others --exclude-standard | rsync -a --from0 --files-from=- ./ $(2)/$(COLLECTION_DIR)/
cd $(2)/$(COLLECTION_DIR) && git init -q && git add -A  # else ansible-test asks the enclosing repo, which ignores .build
mkdir -p ~/.ansible/test/cache
pip=$$($(1)/python -c '$(PY_TEST_PIP)') && cp tests/sanity/get_pip_standin.py ~/.ansible/test/cache/get_pip_$$pip.py
python=$$($(1)/python -c '$(PY_XY)') && cd $(2)/$(COLLECTION_DIR) && \
	$(abspath $(1))/ansible-test sanity --venv --python $$python --color no
endef

sanity: venv system-deps  # system-deps: shellcheck, else ansible-test skips that test with a warning
	$(call sanity-with,$(BIN),$(BUILD)/sanity)

units: venv collection
	$(BIN)/pytest -q tests/unit

simulator-tests: venv collection simulator
	$(BIN)/pytest -q tests/fakegpu/tests

fleet-tests: venv collection simulator
	$(BIN)/pytest -q tests/fleet/tests

# The fleet page in Debian's headless Chromium (tests/browser/page_check.py is also a command).
browser-tests: venv system-deps
	$(BIN)/pytest -q tests/browser

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

## Docs, changelog and execution environment ----------------------------------------------------------------

.PHONY: docs-lint changelog-lint changelog-release ee-check
EE_FILE ?= meta/execution-environment.yml
EE_CONTEXT := $(BUILD)/ee

# Plugin and role docs (schema, markup, O()/M() references) as the docsite would build them, from the collection as
# Ansible finds it; an unknown collection named in a reference is an error. Extra docs (docs/docsite) once there are.
docs-lint: venv collection
	$(BIN)/antsibull-docs lint-collection-docs --plugin-docs --check-extra-docs-refs \
	  --validate-collection-refs all --disallow-unknown-collection-refs $(COLLECTIONS)/$(COLLECTION_DIR)

# Fragments and changelogs/changelog.yaml lint clean, and CHANGELOG.rst is exactly what changelog.yaml generates.
changelog-lint: venv
	$(BIN)/antsibull-changelog lint
	$(BIN)/antsibull-changelog lint-changelog-yaml changelogs/changelog.yaml
	@[ -f CHANGELOG.rst ] || { echo "CHANGELOG.rst is missing: make changelog-release" >&2; exit 1; }
	@generated=$$(mktemp) && trap 'rm -f "$$generated"' EXIT && \
	  $(BIN)/antsibull-changelog generate --output "$$generated" && \
	  diff -u CHANGELOG.rst "$$generated" >&2 || { echo "CHANGELOG.rst is not what changelogs/changelog.yaml generates: antsibull-changelog generate" >&2; exit 1; }
	@echo "changelog: fragments, changelog.yaml and CHANGELOG.rst agree"

# Release galaxy.yml's version: fold the fragments into changelogs/changelog.yaml and write CHANGELOG.rst (the
# fragments are removed: keep_fragments is false). Its plugin cache is rebuilt from the collection at each release.
changelog-release: venv collection
	$(BIN)/antsibull-changelog release
	rm -f changelogs/.plugin-cache.yaml

# ansible-builder create validates the EE definition and writes the build context (a build needs podman or docker).
ee-check: venv
	rm -rf $(EE_CONTEXT)
	$(BIN)/ansible-builder create -f $(EE_FILE) --context $(EE_CONTEXT) --output-filename Containerfile
	@[ -s $(EE_CONTEXT)/Containerfile ] || { echo "ansible-builder wrote no $(EE_CONTEXT)/Containerfile" >&2; exit 1; }
	@$(BIN)/python -c 'import sys, yaml; \
	  want = "ansible-core" + yaml.safe_load(open("meta/runtime.yml"))["requires_ansible"]; \
	  got = yaml.safe_load(open("$(EE_FILE)"))["dependencies"]["ansible_core"]["package_pip"]; \
	  sys.exit(None if got == want else f"$(EE_FILE): ansible_core is {got}, meta/runtime.yml says {want}")'
	@echo "ee-check: $(EE_FILE) is valid; build context in $(EE_CONTEXT)"

## The newest ansible-core (make test covers the oldest, 2.19, in .venv) -------------------------------------

compat: compat-sanity compat-units compat-molecule
	@echo "make compat: ansible-core $$($(COMPAT_BIN)/python -c 'import ansible; print(ansible.__version__)') passed"

compat-sanity: compat-venv system-deps
	$(call sanity-with,$(COMPAT_BIN),$(BUILD)/compat/sanity)

compat-units: compat-venv collection
	PATH=$(COMPAT_PATH) $(COMPAT_BIN)/pytest -q tests/unit

# One scenario (COMPAT_SCENARIO), with this venv's ansible-playbook and molecule first on PATH.
compat-molecule: compat-venv collection simulator
	cd extensions && PATH=$(COMPAT_PATH) molecule test -s $(COMPAT_SCENARIO)

## Benchmarks (not part of make test: timings belong in benchmarks, not in assertions) ---------------------

bench: venv system-deps collection simulator
	$(BIN)/python benchmarks/bench.py

## Demo ----------------------------------------------------------------------------------------------------

demo: venv system-deps collection simulator
	$(BIN)/python tests/demo.py --state-dir $(DEMO_STATE)

clean:
	-$(BIN)/python tests/fleet/fleet.py down --all 2>/dev/null
	rm -rf $(BUILD) tests/output
