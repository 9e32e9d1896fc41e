"""scripts/harness.py's gpu_turn: processes given the same lock file run their blocks one at a
time (how bench_compare.sh times two trees' variant rows in turns)."""
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TURNS = """
import sys, time
sys.path.insert(0, sys.argv[1])
import harness
time.sleep(max(0.0, float(sys.argv[3]) - time.monotonic()))  # (both start together)
for _ in range(4):
    with harness.gpu_turn(sys.argv[2]):
        start = time.monotonic()
        time.sleep(0.1)
        print(start, time.monotonic(), flush=True)
"""


def test_turns_of_two_processes_do_not_overlap(tmp_path):
    lock, start = tmp_path / "gpu.lock", time.monotonic() + 6
    runs = [subprocess.Popen([sys.executable, "-c", TURNS, str(SCRIPTS), str(lock), str(start)],
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    turns = []
    for run in runs:
        stdout, _ = run.communicate(timeout=60)
        assert run.returncode == 0
        turns += [tuple(map(float, line.split())) for line in stdout.splitlines()]
    assert len(turns) == 8
    turns.sort()
    for (_, end), (start, _) in zip(turns, turns[1:]):
        assert start >= end


def test_no_lock_file_is_no_lock():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import harness
        with harness.gpu_turn(None), harness.gpu_turn(None):  # (nested: nothing to wait for)
            pass
    finally:
        sys.path.remove(str(SCRIPTS))
