"""The benchmark scripts still run end to end and print well-formed results (tiny sizes; the figures are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_sampler_bench_reports_both_impls():
    rows = json.loads(_run("sampler_bench.py", "--batch-sizes", "3", "--vocabs", "1000", "--repeats", "1", "--json"))
    assert {r["mode"] for r in rows} == {"plain", "top_p 0.9", "top_k 50"}
    assert all(r["torch_ms"] > 0 and r["chunked_ms"] > 0 for r in rows)


def test_engine_throughput_reports_every_engine_and_refit():
    result = json.loads(_run("engine_throughput.py", "--models", "tiny", "--batch-sizes", "2", "--new-tokens", "4",
                             "--repeats", "1", "--no-compile", "--dtypes", "float32", "--json"))
    engines = {row["engine"] for row in result["throughput"]}
    assert engines == {"native", "hf", "transformers"}
    assert all(row["tokens_per_s"] > 0 and row["speedup_vs_hf_fp32"] is not None for row in result["throughput"])
    assert [(r["engine"], r["dtype"]) for r in result["refit"]] == [("native", "float32")]
