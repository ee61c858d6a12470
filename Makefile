# Two commands do all set-up: `make demo` and `make test`. Each creates .venv from this checkout.
# `make soak` (not part of `make test`): the 30-minute soak, into docs/benchmarks/soak.{json,png}.
# `make soak-cluster` (not part of `make test`): 10 minutes of cluster reads over three daemons.
# `make check-glusterfs` (not part of `make test`, as root): a shared root on a real GlusterFS
# volume mounted twice; installs glusterfs-server/-client if missing; figures into
# docs/benchmarks/glusterfs.json.
# `make check-hosts` (not part of `make test`, as root, about 7 minutes): four hosts (HOSTS=8
# for eight), each a network namespace with its own address, root and daemon on a bridge of
# its own; cluster reads bit for bit from ranks inside them; a host whose link drops packets
# during a collection and a rolling token rotation; links shaped at 10 and 1 Gbit/s against
# raw TCP; a soak across the hosts (SOAK_S seconds, 180 by default). Figures:
# docs/benchmarks/hosts-$(HOSTS).json (HOSTS_REPORT=... to write them elsewhere).
# `make check-container` (not part of `make test`, as root): the image of
# deploy/container/Dockerfile built with podman and run as a sidecar; installs podman, runc
# and debootstrap if missing.
# `make check-vllm` (not part of `make test`): a real vLLM (its CPU build) on a tiny random
# Qwen3-MoE model, in-process and as its OpenAI-compatible server on 127.0.0.1, writing into a
# real daemon; installs .venv-vllm on first use (about 9 minutes, 3.5 GB; kept between runs);
# figures into docs/benchmarks/vllm-*.json; also reads into torch tensors (`out=`, its torch).
# The last line says `check-vllm: OK` or what failed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest soak soak-cluster check-glusterfs check-hosts check-container check-vllm clean

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./client -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/payloadd demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/payloadd soak --duration 1800 --kill-every 600 \
	    --json docs/benchmarks/soak.json --plot docs/benchmarks/soak.png $(SOAK_ARGS)

SOAK_CLUSTER_SECONDS ?= 600
soak-cluster: $(STAMP)
	$(BIN)/python -m tests.payloadd.soak_cluster --seconds $(SOAK_CLUSTER_SECONDS)

check-container:
	bash deploy/container/check.sh

HOSTS ?= 4
SOAK_S ?= 180
HOSTS_REPORT ?= docs/benchmarks/hosts-$(HOSTS).json

check-hosts: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "check-hosts makes network namespaces: run it as root"; exit 1; }
	PAYLOADD_HOSTS=1 PAYLOADD_HOSTS_N=$(HOSTS) PAYLOADD_HOSTS_SOAK_S=$(SOAK_S) \
	    PAYLOADD_HOSTS_REPORT=$(HOSTS_REPORT) \
	    $(BIN)/pytest tests/integration/test_hosts.py -v -s -p no:cacheprovider

check-glusterfs: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "check-glusterfs runs glusterd and FUSE mounts: run it as root"; exit 1; }
	PAYLOADD_GLUSTERFS=1 PAYLOADD_GLUSTERFS_REPORT=docs/benchmarks/glusterfs.json \
	    $(BIN)/pytest tests/integration -v -s -p no:cacheprovider

VLLM_VENV ?= .venv-vllm
check-vllm:
	VLLM_VENV=$(VLLM_VENV) bash tests/vllm/setup.sh
	@if PAYLOADD_CHECK_OUT=docs/benchmarks $(VLLM_VENV)/bin/pytest tests/vllm \
	    tests/client/test_torch_out.py -v -s -p no:cacheprovider; then echo "check-vllm: OK"; \
	else echo "check-vllm: FAILED (the failures above say what)"; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
