"""The tiny workflow through the SLURM profile, on a real one-node SLURM cluster.

tests/slurm/cluster.sh installs SLURM from Debian packages and starts munge,
MariaDB, slurmdbd, slurmctld and slurmd on localhost with two fake GPUs;
sacct then shows which jobs ran under SLURM and what they were given. Skipped,
with the reason, where the machine cannot (not root, no apt-get, a SLURM of its
own).
"""

import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, copy_config, job_counts, snakemake

pytestmark = pytest.mark.slow

CLUSTER = REPO / "tests/slurm/cluster.sh"
PROFILE = REPO / "profiles/slurm"
LOCAL_RULES = {"all", "accuracy_table", "accuracy_paired", "mediation_table", "placement_table", "prepare_model"}


def declared_gpu_rules() -> set[str]:
    """The rules whose resources declare gpu=1, read from workflow/rules/*.smk."""
    import re

    rules = set()
    for path in (REPO / "workflow" / "rules").glob("*.smk"):
        for name, body in re.findall(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", path.read_text(), re.S | re.M):
            if re.search(r"^\s+gpu=1,", body, re.M):
                rules.add(name)
    return rules


GPU_RULES = declared_gpu_rules()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = subprocess.run([CLUSTER, "check"], capture_output=True, text=True)
    if why.returncode:
        pytest.skip(f"no SLURM cluster test here: {why.stdout.strip()}")
    installed = subprocess.run([CLUSTER, "install"], capture_output=True, text=True, timeout=900)
    if installed.returncode:
        pytest.skip(f"no SLURM cluster test here: installing SLURM failed: {installed.stderr[-500:]}")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["timeout", "-k", "5", "120", CLUSTER, "start", state],
                             capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield state
    finally:
        subprocess.run([CLUSTER, "stop", state], check=False, timeout=120)


def _sacct(since: str) -> list[dict]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", since, "--format=JobID,Comment%300,AllocTRES%200,State"],
        capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(("id", "comment", "tres", "state"), line.split("|"))) for line in out.splitlines()]
    return [row for row in rows if row["comment"].startswith("rule_")]


def _rule(comment: str) -> str:
    return comment[len("rule_"):].split("_wildcards_")[0]


def _one_dataset_config(workdir: Path) -> Path:
    """tests/configs/tiny.yaml without GSM8K: every rule of the tiny run still runs, in fewer jobs (each
    SLURM job starts a Snakemake of its own, and the test was the suite's longest)."""
    import yaml

    config = copy_config("tiny.yaml", workdir)
    settings = yaml.safe_load(config.read_text())
    del settings["datasets"]["gsm8k"]
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    return config


def test_tiny_workflow_runs_as_slurm_jobs(cluster, tmp_path):
    config = _one_dataset_config(tmp_path)
    args = ["--workflow-profile", str(PROFILE), "--configfile", str(config)]
    planned = job_counts(snakemake("-n", *args, workdir=tmp_path).stdout)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 2))
    # The fake node has as many CPUs as this machine: cap every job's threads at 1.
    run = snakemake(*args, "--max-threads", "1", "--slurm-init-seconds-before-status-checks", "2",
                    "--seconds-between-status-checks", "2", workdir=tmp_path, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:]

    jobs = _sacct(since)
    ran = {}
    for job in jobs:
        ran[_rule(job["comment"])] = ran.get(_rule(job["comment"]), 0) + 1
    expected = {rule: n for rule, n in planned.items() if rule not in LOCAL_RULES | {"total"}}
    assert ran == expected  # every compute job, once, as a SLURM job; no local rule submitted
    assert all(job["state"] == "COMPLETED" for job in jobs)
    for job in jobs:
        has_gpu = "gres/gpu=1" in job["tres"]
        assert has_gpu == (_rule(job["comment"]) in GPU_RULES), job
    # The outputs are those of a local run.
    assert (Path(tmp_path) / "results/tables/accuracy.csv").is_file()
    assert (Path(tmp_path) / "results/figures/pruning/corrupted/ioi.png").is_file()
