"""A job's process setup (attnlab.steps.setup_logging): its log holds everything the job wrote,
and the interpreter's last garbage collections are skipped (objects frozen at exit)."""

import subprocess
import sys
import textwrap


def test_log_is_complete_and_objects_are_frozen_at_exit(tmp_path):
    log_path = tmp_path / "job.log"
    child = textwrap.dedent(f"""
        import atexit, gc, sys
        # registered before setup_logging, so it runs after setup_logging's own exit handler
        atexit.register(lambda: sys.stderr.write(f"\\nfrozen at exit: {{gc.get_freeze_count() > 0}}\\n"))
        from attnlab import steps
        steps.setup_logging({str(log_path)!r})
        steps.common.log.info("outputs written")
        sys.stderr.write("a progress bar without a newline")
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    text = log_path.read_text()
    assert "INFO attnlab: outputs written" in text
    assert "a progress bar without a newline" in text
    assert "frozen at exit: True" in text
