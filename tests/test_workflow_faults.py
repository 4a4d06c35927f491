"""The tiny run's report and its faults: the HTML report holds every figure and table with their
definitions; a job that runs out of memory is retried with half the batch; a killed extraction
leaves no file that looks complete. After test_workflow.py, whose rerun checks need the run as it
finished (the faults force jobs again)."""

import os
import signal
import subprocess
import sys
import time

import h5py
import pandas as pd
import pytest

from test_workflow import DATASETS, MODEL

pytestmark = pytest.mark.slow


def test_report_holds_every_figure_and_table_with_definitions(tiny_report):
    import html
    import zipfile

    with zipfile.ZipFile(tiny_report) as archive:
        raw = [n for n in archive.namelist() if n.startswith("report/data/raw/")]
        page = html.unescape(archive.read("report/report.html").decode())
    expected = [f"results/figures/accuracy/{d}.png" for d in DATASETS]
    expected += [f"results/figures/placement/{d}.png" for d in DATASETS]
    expected += [f"results/figures/attention/{MODEL}/svamp/{name}.png" for name in ("layer0_head0", "lambda")]
    expected += ["results/figures/attention/composite/head1_layers1-2.png"]
    expected += [f"results/figures/mlp/{MODEL}/svamp.png", "results/figures/pruning/corrupted/ioi.png",
                 "results/figures/pruning/corrupted/tasks.png",
                 "results/tables/accuracy.csv", f"results/tables/mlp/{MODEL}/svamp.csv"]
    expected += [f"results/tables/placement/{d}.csv" for d in DATASETS]
    expected += [f"results/tables/accuracy_paired/{d}.csv" for d in DATASETS]
    expected += [f"results/figures/mediation/{MODEL}/svamp/mless.png", "results/tables/mediation.csv"]
    for path in expected:
        assert path in page, path
    assert len(raw) == len(expected) + 1  # and the top-changed head's figure
    # captions state the definitions
    for definition in ("mean over i > j", "Explained effect = (m(k)", "verify(parse(gold), parse(pred))",
                       "act_fn(gate_proj(x))", "Gini coefficient", "1.4826", "Wilson score", "Newcombe",
                       "mean effect over items / the mean total effect", "CPR, the area under the curve"):
        assert definition in page, definition
    # no docutils message (a red "System Message" box inside a caption): tests/test_report_captions.py
    # renders every caption alone, this the report as built
    assert "System Message" not in page and "system-message" not in page


# ---- faults ----


def test_out_of_memory_retry_halves_the_batch(tiny_run):
    workdir, config, snakefile = tiny_run
    target = f"results/generations/{MODEL}/svamp/none.parquet"
    env = {**os.environ, "ATTNLAB_TEST_OOM_ABOVE_BATCH": "1"}  # batch 4 and 2 fail, 1 runs
    command = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir),
               "--cores", "1", "--configfile", str(config), "--retries", "2", "-f", target]
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("Trying to restart job") == 2
    log = (workdir / f"results/logs/generate/{MODEL}/svamp/none.log").read_text()
    assert "batch size 1 (configured 4, halved for a retry after running out of memory)" in log
    assert len(pd.read_parquet(workdir / target)) == 4


def test_killed_extraction_is_not_taken_as_complete(tiny_run):
    workdir, config, snakefile = tiny_run
    target = workdir / f"results/attention/{MODEL}/svamp/mless.h5"
    command = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir)]
    options = ["--cores", "1", "--configfile", str(config)]
    log = workdir / f"results/logs/extract_attention/{MODEL}/svamp/mless.log"
    log.unlink(missing_ok=True)  # its content from the first run must not trigger the kill
    relative = str(target.relative_to(workdir))  # targets are paths in the working directory
    job = subprocess.Popen([*command, "-f", relative, *options], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    # Kill Snakemake and its job while the model runs over the prompts.
    deadline = time.time() + 300
    while job.poll() is None and time.time() < deadline:
        if log.exists() and "extracting" in log.read_text():
            os.killpg(job.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    job.wait(timeout=60)
    assert job.returncode == -signal.SIGKILL, "the extraction finished before it could be killed"
    assert not target.exists()  # the partial file never has the final name
    # A killed Snakemake leaves its directory lock behind: --unlock, as its message says.
    unlock = subprocess.run([*command, "--unlock", *options], capture_output=True, text=True, timeout=120, check=False)
    assert unlock.returncode == 0, unlock.stdout + unlock.stderr
    rerun = subprocess.run([*command, relative, *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=900, check=False)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "extract_attention" in rerun.stdout
    with h5py.File(target) as h5:
        assert h5.attrs["complete"]
    assert not list(target.parent.glob(f".{target.name}.tmp-*"))  # no leftovers
