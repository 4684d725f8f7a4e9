# Two commands: `make demo` and `make test`. Each sets up .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,examples]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipetrain.cli demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist loadfile

# The everyday path: every test but those marked slow (CI runs `make test`, all of them).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV) runs
