# Two commands on a fresh machine:  make run   (install + embedded default workflow)
#                                   make test  (install + test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.attnlab-installed

.PHONY: install run mechanism sparse test test-fast lint dry-run report clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

run: install
	$(BIN)/snakemake --cores all

mechanism: install
	$(BIN)/snakemake --cores all --configfile config/mechanism.yaml

sparse: install
	$(BIN)/snakemake --cores all --configfile config/sparse.yaml

test: install
	$(BIN)/python -m pytest -ra

test-fast: install
	$(BIN)/python -m pytest -ra -m "not slow"

lint: install
	$(BIN)/snakemake --lint

dry-run: install
	$(BIN)/snakemake -n --cores 1

report: install
	$(BIN)/snakemake --cores 1 --report results/report.html

clean:
	rm -rf results/* resources .snakemake
	touch results/.gitkeep
