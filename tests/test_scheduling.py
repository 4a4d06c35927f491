"""The post-training of a sparse copy starts before the base's jobs on a workstation: Snakemake's
MILP scheduler maximises the sum of the priorities of the jobs it starts together (its
scheduling/milp.py objective), so a rule that must go first needs a priority above what the other
rules' jobs, one per core, add up to. At priority 2 on 2 cores, two scoring jobs (1 each) tied
with the post-training, and the solver started them first (make sparse, 2026-11-28)."""

import re
from pathlib import Path

RULES = Path(__file__).resolve().parents[1] / "workflow" / "rules"
WORKSTATION_CORES = 16


def _priorities() -> dict[str, int]:
    found = {}
    for path in RULES.glob("*.smk"):
        for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", path.read_text(), re.M | re.S):
            match = re.search(r"^\s+priority:\s*(\d+)", body, re.M)
            found[rule] = int(match.group(1)) if match else 0
    return found


def test_the_post_training_outweighs_a_workstations_cores_of_other_jobs():
    priorities = _priorities()
    assert "sparsify_model" in priorities and "score_heads" in priorities  # the parse found the rules
    others = max(p for rule, p in priorities.items() if rule != "sparsify_model")
    assert priorities["sparsify_model"] > WORKSTATION_CORES * others
