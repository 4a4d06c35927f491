"""Post-train a configured sparse copy outside Snakemake (a GPU node without the workflow's
tools): the same settings, validation and outputs as the workflow's sparsify_model rule.

    python -m benchmarks.gpu.sparse_regime --config config/sparse-gpu.yaml --model smollm2-135m-sparse \
        --base-dir resources/models/smollm2-135m --out results/sparsify-gpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, help="the sparse copy's name in the config")
    parser.add_argument("--base-dir", required=True, help="the prepared dense base model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()

    from attnlab import steps
    from attnlab.config.schema import validate_config

    config = yaml.safe_load(Path(args.config).read_text())
    validate_config(config, REPO / "config" / "schema.yaml")
    settings = config["models"][args.model]["source"]["sparsify"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps.setup_logging(str(out / "sparsify.log"))
    outputs = {"model": str(out / "model"), "steps": str(out / "steps.csv"), "evals": str(out / "eval.csv"),
               "density": str(out / "density.csv"), "summary": str(out / "summary.json")}
    steps.sparsify_model(args.model, args.base_dir, settings, outputs, str(out / "checkpoint" / "checkpoint.pt"),
                         args.threads)


if __name__ == "__main__":
    main()
