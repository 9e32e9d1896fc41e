"""scripts/overhead_cpu.py, the proxy for a replayed call's host time without a GPU, still
matches the code: in a process of its own (it stubs the driver and makes CPU tensors read as
CUDA ones) every row runs and every timed call is a replay (the script stops otherwise)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_every_row_runs_as_replays():
    run = subprocess.run([sys.executable, "overhead_cpu.py", "--calls", "20", "--rounds", "1"],
                         cwd=SCRIPTS, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.endswith("us per call")]
    assert [row.split("  ")[0] for row in rows][:3] == [
        "api.forward", "api.backward", "torch.attention forward + backward"], run.stdout
    assert all(float(row.split()[-4]) > 0 for row in rows)
