# Two commands on a fresh machine:  make run   (install + embedded default workflow)
#                                   make test  (install + test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.attnlab-installed

.PHONY: mutations install run mechanism sparse sparse-edges sparse-mean sparse-zero sparse-gpu groundtruth groundtruth-models edge-methods test test-fast lint dry-run report clean bench-peers bench-edge-peers

install: $(STAMP)

# pip compiles bytecode one file at a time (66 s of a 106 s install on 2 cores); compileall
# on every core takes 43 s, and jobs then start without compiling, even where
# PYTHONDONTWRITEBYTECODE is set. Left out, as no job imports them: the packages' own test
# suites (tests/ and test/ folders: pandas, scipy, numpy...; 37 s instead of 47 s measured
# together), pip and setuptools, and transformers' model folders other than the embedded models'
# and the auto classes' (2,700 of its 2,860 files; another architecture compiles on first use):
# 3,254 of 12,055 files. A few files written for newer Pythons fail to compile, as under pip.
COMPILE_SKIP = /tests?/|/site-packages/(pip|setuptools|pkg_resources)/|/transformers/models/(?!(auto|llama|gemma|gemma3|encoder_decoder)/)[^/]+/
$(STAMP): requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-compile --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m compileall -q -j 0 -x '$(COMPILE_SKIP)' $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') > /dev/null 2>&1 || true
	touch $@

run: install
	$(BIN)/snakemake --cores all

mechanism: install
	$(BIN)/snakemake --cores all --configfile config/mechanism.yaml

sparse: install
	$(BIN)/snakemake --cores all --configfile config/sparse.yaml

# After make sparse: both models' IOI edge circuits (about 4 minutes more).
sparse-edges: sparse
	$(BIN)/snakemake --cores all --configfile config/sparse.yaml config/sparse-edges.yaml

# make sparse with mean ablation too (after make sparse, every scoring job runs again: one job
# scores every configured ablation).
sparse-mean: install
	$(BIN)/snakemake --cores all --configfile config/sparse.yaml config/sparse-mean.yaml

# make sparse with zero ablation too (likewise).
sparse-zero: install
	$(BIN)/snakemake --cores all --configfile config/sparse.yaml config/sparse-zero.yaml

# The paper's regime on one GPU (config/sparse-gpu.yaml): stops before training without CUDA.
sparse-gpu: install
	$(BIN)/snakemake --cores all --configfile config/sparse-gpu.yaml

# Every circuit method against circuits known by construction (data/groundtruth, committed).
groundtruth: install
	$(BIN)/snakemake --cores all --configfile config/groundtruth.yaml

# EAP-IG, ACDC and Edge Pruning on Gemma-3's IOI edges (config/edge-methods.yaml), each through the
# workflow's edge step, compared: edges to 0.9, areas, time (about 1.5 hours on 2 cores).
edge-methods: install
	$(BIN)/python -m benchmarks.throughput.edge_methods

# Rebuild data/groundtruth with tracr, in a virtualenv of its own (tracr and jax are an optional
# extra that the workflow never needs): compiles, converts, and checks each model against tracr.
TRACR_VENV ?= .venv-tracr
groundtruth-models:
	test -x $(TRACR_VENV)/bin/python || $(PYTHON) -m venv $(TRACR_VENV)
	$(TRACR_VENV)/bin/python -m pip install --quiet -r requirements.txt -c constraints.txt
	$(TRACR_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(TRACR_VENV)/bin/python -m pip install --quiet "tracr-pypi==1.0.0"
	$(TRACR_VENV)/bin/python -m attnlab.groundtruth.build data/groundtruth

TEST_STAMP = $(VENV)/.attnlab-test-installed

$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(BIN)/python -m pip install --quiet -r requirements-test.txt -c constraints.txt
	touch $@

# One process: two pytest-xdist workers were measured slower on 2 cores (43 min 40 s against 34
# min 14 s), each worker's torch threads and the workflow's jobs contending for the same cores.
test: install $(TEST_STAMP)
	$(BIN)/python -m pytest -ra

test-fast: install $(TEST_STAMP)
	$(BIN)/python -m pytest -ra -m "not slow"

# Every entry of tests/mutations.md applied in turn in a scratch copy: lists any bug its tests no
# longer catch (about an hour on 2 cores; not part of CI).
mutations: install $(TEST_STAMP)
	$(BIN)/python tests/run_mutations.py $(ONLY)

lint: install
	$(BIN)/snakemake --lint

dry-run: install
	$(BIN)/snakemake -n --cores 1

report: install
	$(BIN)/snakemake --cores 1 --report results/report.html

# attnlab side by side with TransformerLens and nnsight (benchmarks/peers/heads.py). The peers
# live in their own virtualenv, never in the project's: torch first (the pinned build),
# then the peers with constraints that keep torch and transformers at the project's pins.
PEERS_VENV  ?= .venv-peers
PEERS_STAMP  = $(PEERS_VENV)/.peers-installed
PEERS_MODELS = resources/models/smollm2-135m resources/models/gemma3-270m

$(PEERS_STAMP): benchmarks/peers/requirements.txt benchmarks/peers/constraints.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip install --quiet -r benchmarks/peers/requirements.txt -c benchmarks/peers/constraints.txt
	touch $@

$(PEERS_MODELS): | $(STAMP)
	$(BIN)/snakemake --cores 1 $@

bench-peers: install $(PEERS_STAMP) $(PEERS_MODELS)
	$(BIN)/python -m benchmarks.peers.heads --peer-python $(PEERS_VENV)/bin/python $(PEERS_ARGS)

# attnlab's edge scores beside auto-circuit's (benchmarks/peers/edges.py). auto-circuit 1.0.1 needs
# TransformerLens' HookedTransformer, which 4.x removed: its own virtualenv, TransformerLens 3.9
# (benchmarks/peers/autocircuit-requirements.txt says why each piece is there).
AUTOCIRCUIT_VENV  ?= .venv-autocircuit
AUTOCIRCUIT_STAMP  = $(AUTOCIRCUIT_VENV)/.autocircuit-installed

$(AUTOCIRCUIT_STAMP): benchmarks/peers/autocircuit-requirements.txt benchmarks/peers/constraints.txt
	test -x $(AUTOCIRCUIT_VENV)/bin/python || $(PYTHON) -m venv $(AUTOCIRCUIT_VENV)
	$(AUTOCIRCUIT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AUTOCIRCUIT_VENV)/bin/python -m pip install --quiet torch==2.13.0
	grep -v '^transformer-lens' benchmarks/peers/constraints.txt > $(AUTOCIRCUIT_VENV)/constraints.txt
	$(AUTOCIRCUIT_VENV)/bin/python -m pip install --quiet -r benchmarks/peers/autocircuit-requirements.txt -c $(AUTOCIRCUIT_VENV)/constraints.txt
	$(AUTOCIRCUIT_VENV)/bin/python -m pip install --quiet --no-deps auto-circuit==1.0.1
	touch $@

bench-edge-peers: install $(AUTOCIRCUIT_STAMP)
	$(BIN)/python -m benchmarks.peers.edges --peer-python $(AUTOCIRCUIT_VENV)/bin/python $(EDGE_PEERS_ARGS)
	$(BIN)/python -m benchmarks.peers.circuits --peer-python $(AUTOCIRCUIT_VENV)/bin/python $(EDGE_CIRCUITS_ARGS)

clean:
	rm -rf results/* resources .snakemake
	touch results/.gitkeep
