"""benchmarks/peers/nanogpt.py at tiny dims on CPU, eager: its JSON line, and the error line when nanoGPT is missing.

nanoGPT's model.py is not part of this repository; the run test skips unless it sits at .peer/nanogpt/model.py.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers" / "nanogpt.py"
NANOGPT_DIR = ROOT / ".peer" / "nanogpt"
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "vocab_size": 256, "batch": 2}


def _torch():
    # exc_type=ImportError: a torch that is installed but cannot load (missing native libraries) also skips.
    pytest.importorskip("torch", reason="torch is not importable (pip install 'jaxperf[peer]')", exc_type=ImportError)


def _run(nanogpt_dir: Path, *extra: str) -> tuple[int, dict, str]:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    p = subprocess.run([sys.executable, str(SCRIPT), f"--nanogpt-dir={nanogpt_dir}", *args, "--steps=2", "--warmup=1",
                        "--device=cpu", "--compile=0", *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = p.stdout.splitlines()
    assert len(lines) == 1, f"expected one JSON line on stdout, got {p.stdout!r}\nstderr:\n{p.stderr[-3000:]}"
    return p.returncode, json.loads(lines[0]), p.stderr


def test_nanogpt_peer_runs_and_counts_flops():
    _torch()
    if not (NANOGPT_DIR / "model.py").is_file():
        pytest.skip(f"nanoGPT's model.py is not at {NANOGPT_DIR} (it is never committed: copy it from a nanoGPT "
                    "checkout)")
    rc, r, err = _run(NANOGPT_DIR)
    assert rc == 0 and "error" not in r, f"{r}\nstderr:\n{err[-3000:]}"
    assert r["bench"] == "train_step" and r["peer"] == "nanogpt" and r["device_kind"] == "cpu"
    assert {k: r[k] for k in TINY} == TINY and r["compile"] is False
    assert r["tokens_per_s"] > 0 and 0 < r["step_time_s"]["min"] <= r["step_time_s"]["median"]
    assert r["compile_s"] > 0 and r["mfu"] is None and r["peak_bytes"] is None
    assert all(math.isfinite(v) for v in r["loss_first_last"]), r["loss_first_last"]

    # GPT-2 layout with biases and a tied head: token + position embeddings, per layer two LayerNorms (2D each),
    # qkv (D x 3D + 3D), attention out (D x D + D), MLP (D x 4D + 4D, 4D x D + D); a final LayerNorm.
    L, H, D, T, V = (TINY[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))
    with_pos = V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D
    attention = 12 * L * H * (D // H) * T
    assert r["flops_per_token_nanogpt"] == 6 * (with_pos - T * D) + attention
    assert r["flops_per_token_with_pos"] == 6 * with_pos + attention


def test_nanogpt_peer_reports_missing_model(tmp_path):
    _torch()
    rc, r, err = _run(tmp_path)
    assert rc == 1, r
    assert r["error"].startswith("FileNotFoundError") and str(tmp_path / "model.py") in r["error"], r["error"]
    assert r["tokens_per_s"] is None and r["n_layer"] == TINY["n_layer"]
    assert "Traceback" in err
