"""Every benchmark still runs against the code it measures (tiny sizes; the figures are not
checked: speed is measured by the benchmarks themselves, on a quiet machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

RUNS = {
    "tap_throughput.py": ["--batches", "300", "--rounds", "1"],
    "record_throughput.py": ["--batches", "300", "--rounds", "1"],
    "record_throughput.py --convert": ["--convert", "--batches", "300", "--rounds", "1"],
    "record_sustained.py": ["--rate", "5000", "--seconds", "2", "--every", "1"],
    "replay_throughput.py": ["--batches", "300", "--rounds", "1"],
    "pacing.py": ["--seconds", "0.05", "--rounds", "1"],
    "index.py": ["--workers", "2", "--requests", "50", "--rounds", "1", "--blocks", "3000"]
    + ["--prompt-tokens", "2048", "--queries", "20"],
    "record_disk.py": ["--events", "3000", "--columns"],
    "record_stream.py": ["--messages", "2000", "--rounds", "1"],
    "record_stream.py --cluster": ["--messages", "1000", "--rounds", "1", "--cluster"]
    + ["--replicas", "3", "--recorders", "2", "--bridge"],
    "stats_dataset_memory.py": ["--rows", "20000", "40000", "--requests", "50"],
    "record_disk.py --tokens random": ["--tokens", "random", "--batches", "300"],
    "sim_throughput.py": ["--workers", "2", "--requests", "50", "--repeat", "1"],
    "simulate_output.py": ["--requests", "50", "--rounds", "1"],
    "startup.py": ["--rounds", "1"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs(name):
    script = BENCH / name.split()[0]
    result = subprocess.run(
        [sys.executable, str(script), *RUNS[name]],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "a benchmark prints its figures"


def test_the_capacity_table_is_computed_from_figures(tmp_path):
    figures = tmp_path / "figures.jsonl"
    figures.write_text(
        '{"replicas": 3, "cluster": true, "recorders": 1, "bridge": 8000, '
        '"record_up_to_acked": 16000}\n'
    )
    result = subprocess.run(
        [sys.executable, str(BENCH / "capacity.py"), str(figures), "--workers", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    # 1,000 workers x 100 batches/s over recorders loaded to 8,000 msg/s: 13 recorders
    assert "| 1,000 | 100,000 | 119 | 125 | 10% | 13 | 32 |" in result.stdout
