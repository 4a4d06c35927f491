#!/usr/bin/env bash
# Cold run of the embedded default workflow in a fresh working directory,
# then a second run with nothing changed. Prints wall-clock seconds of both.
#   bash benchmarks/throughput/end_to_end.sh [extra snakemake args]
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"  # two folders down: benchmarks/throughput/
snakemake="${SNAKEMAKE:-$repo/.venv/bin/snakemake}"  # the project's, unless named
workdir="$(mktemp -d "${TMPDIR:-/tmp}/attnlab-e2e.XXXXXX")"
mkdir -p "$repo/benchmarks/out"

now() { date +%s%N; }

start=$(now)
"$snakemake" -s "$repo/Snakefile" -d "$workdir" --cores all "$@" > "$repo/benchmarks/out/e2e-cold.log" 2>&1
cold=$(( ($(now) - start) / 1000000 ))

start=$(now)
"$snakemake" -s "$repo/Snakefile" -d "$workdir" --cores all "$@" > "$repo/benchmarks/out/e2e-warm.log" 2>&1
warm=$(( ($(now) - start) / 1000000 ))
jobs=$(grep -c "Finished job" "$repo/benchmarks/out/e2e-warm.log" || true)

printf '{"cold_s": %d.%03d, "second_run_s": %d.%03d, "second_run_jobs": %d, "workdir": "%s"}\n' \
    $((cold / 1000)) $((cold % 1000)) $((warm / 1000)) $((warm % 1000)) "$jobs" "$workdir" | tee "$repo/benchmarks/out/end_to_end.json"
