"""A few rules of the tiny workflow through the SLURM profile, on a real one-node SLURM cluster.

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
GRADES = ("results/grades/smollm2-135m/svamp/none.csv", "results/grades/smollm2-135m/svamp/none.json")
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
        ["sacct", "-X", "-n", "-P", "-S", since, "--format=JobID,Comment%300,AllocTRES%200,State,ReqMem,Timelimit"],
        capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(("id", "comment", "tres", "state", "memory", "limit"), line.split("|")))
            for line in out.splitlines()]
    return [row for row in rows if row["comment"].startswith("rule_")]


def _rule(comment: str) -> str:
    return comment[len("rule_"):].split("_wildcards_")[0]


def _few_rules_config(workdir: Path) -> Path:
    """tests/configs/tiny.yaml cut to one cell (SmolLM2 × svamp × none): a local rule, CPU rules and a
    GPU rule (generate), enough to check routing, GPU allocation and resources (each SLURM job starts
    a Snakemake of its own: the whole tiny run took 6.5 minutes this way). Its cell is computed as
    the tiny run computes it, so its tables are that run's."""
    import yaml

    config = copy_config("tiny.yaml", workdir)
    settings = yaml.safe_load(config.read_text())
    del settings["datasets"]["gsm8k"]
    settings["conditions"] = {"none": settings["conditions"]["none"]}
    for section in ("mlp", "mediation"):
        del settings[section]
    settings["attention"] = {"datasets": [], "top_changed": {"k": 0}}
    settings["pruning"] = {"tasks": {}}
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    return config


def _planned_resources(dry_run: str) -> dict[str, tuple[int, int]]:
    """(mem_mb, runtime in minutes) of each rule, as the dry run through the profile plans it."""
    import re

    planned = {}
    for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", dry_run, re.S | re.M):
        memory, runtime = re.search(r"mem_mb=(\d+)", body), re.search(r"runtime=(\d+)", body)
        if memory and runtime:
            planned[rule] = (int(memory.group(1)), int(runtime.group(1)))
    return planned


def _minutes(limit: str) -> int:
    """sacct's Timelimit ([D-]HH:MM:SS) in minutes."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, _ = (int(part) for part in clock.split(":"))
    return int(days or 0) * 1440 + hours * 60 + minutes


def test_a_few_rules_run_as_slurm_jobs_with_their_gpus_and_resources(cluster, tmp_path, tiny_run):
    config = _few_rules_config(tmp_path)
    # the cell's grades as targets (before --configfile, which takes every value after it): the
    # accuracy table and its figure would add a local rule and a CPU job like those here
    args = [*GRADES, "--workflow-profile", str(PROFILE), "--configfile", str(config)]
    dry = snakemake("-n", *args, workdir=tmp_path).stdout
    planned, resources = job_counts(dry), _planned_resources(dry)
    assert GPU_RULES & set(planned) and set(planned) - GPU_RULES - LOCAL_RULES - {"total"}, planned
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 2))
    # The fake node has as many CPUs as this machine: cap every job's threads at 1.
    run = snakemake(*args, "--max-threads", "1", "--slurm-init-seconds-before-status-checks", "2",
                    "--seconds-between-status-checks", "2", workdir=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:]

    jobs = _sacct(since)
    ran = {}
    for job in jobs:
        ran[_rule(job["comment"])] = ran.get(_rule(job["comment"]), 0) + 1
    expected = {rule: n for rule, n in planned.items() if rule not in LOCAL_RULES | {"total"}}
    assert ran == expected  # every compute job, once, as a SLURM job; no local rule submitted
    assert all(job["state"] == "COMPLETED" for job in jobs)
    for job in jobs:
        rule = _rule(job["comment"])
        assert ("gres/gpu=1" in job["tres"]) == (rule in GPU_RULES), job
        # the memory and time each rule declares, as SLURM granted them
        assert job["memory"] == f"{resources[rule][0]}M" and _minutes(job["limit"]) == resources[rule][1], job
    # The outputs are those of the local tiny run, which computed the same cell.
    workdir = tiny_run[0]
    for table in GRADES:
        assert (tmp_path / table).read_bytes() == (workdir / table).read_bytes(), table
