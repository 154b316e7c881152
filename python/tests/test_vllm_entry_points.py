"""The vLLM pieces other scripts run: the chat workload (scripts/run) and the TTFT benchmark's JSON contract
(scripts/bench ttft), on small cases."""

import json
import math
import os
import subprocess
import sys

import pytest

from orbitkv.demo import chat
from vllm_harness.manager import ManagerProcess


@pytest.fixture()
def manager(build_dir):
    m = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    yield m
    m.close()


def test_chat_workload_restores_history_and_matches_recompute(manager, capsys):
    # Every hit taken: whether the cost model declines a short history as slower than recomputing it depends on the
    # machine's timing (the cost model has its own tests in test_vllm_layerwise.py); this test is about restoring.
    assert chat.main(["--socket", manager.socket, "--conversations", "2", "--turns", "3", "--system-tokens", "96",
                      "--user-tokens", "24", "--reply-tokens", "6", "--take-every-hit"]) == 0
    out = capsys.readouterr().out
    assert "replies identical with and without OrbitKV: 6/6; Manager leases held: 0" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert int(rows[0][2]) == 0 and int(rows[2][2]) > 0  # restored tokens per turn: none, then the history
    assert manager.stats()["leases_active"] == 0


def test_chat_rejects_bad_arguments_and_a_missing_manager(tmp_path, capsys):
    with pytest.raises(SystemExit):
        chat.main(["--turns", "0"])
    assert chat.main(["--socket", str(tmp_path / "none.sock")]) == 1
    assert "no OrbitKV Manager" in capsys.readouterr().err


def test_ttft_bench_json_contract(root, build_dir):
    env = dict(os.environ, ORBITKV_BUILD_DIR=str(build_dir), PYTHONPATH=str(root / "python"))
    out = subprocess.run([sys.executable, str(root / "benches" / "ttft_bench.py"), "--json", "--lengths",
                          "256,512", "--plot", str(build_dir / "ttft-test.png")], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    report = json.loads(out)
    assert report["bench"] == "ttft"
    metrics = {r["metric"]: r for r in report["results"]}
    assert {"ttft_256_cached", "ttft_512_cached", "ttft_512_recompute", "restore_512_gbps"} <= set(metrics)
    assert metrics["ttft_512_cached"]["baseline_metric"] == "ttft_512_ideal"
    assert metrics["ttft_512_recompute"]["baseline_metric"] == "ttft_512_cached"
    # Short prompts carry a second recompute engine: the noise floor of cached_vs_recompute.
    assert metrics["ttft_512_recompute_control"]["baseline_metric"] == "ttft_512_recompute"
    for r in report["results"]:
        assert set(r) == {"metric", "unit", "value", "baseline_metric", "baseline", "ratio"}
        assert r["value"] > 0 and r["baseline"] > 0
        assert math.isclose(r["ratio"], r["value"] / r["baseline"], rel_tol=1e-9)
    assert all(row["same_first_token"] and row["restored_tokens"] > 0 for row in report["env"]["rows"])
    # A load's time split: the connector before its first request, then the Manager (one request a load in async
    # mode), each a part of the whole.
    for row in report["env"]["rows"]:
        assert 0 < row["async_restore_start_ms"] < row["async_restore_ms"]
        assert 0 < row["async_manager_restore_ms"] < row["async_restore_ms"]
        assert 0 < row["async_manager_submit_ms"] < row["async_manager_restore_ms"]
        assert 0 < row["async_restore_gbps_min"] <= row["async_restore_gbps"] <= row["async_restore_gbps_max"]
        # The steps' wait for the device is a part of their compute (on CPU, next to nothing).
        for kind in ("recompute", "layerwise", "async", "served"):
            assert 0 <= row[f"{kind}_gpu_wait_ms"] <= row[f"{kind}_compute_s"] * 1e3
        assert len(row["served_ttfts_ms"]) == report["env"]["short_prompt_repeats"]
    assert "plot" in report["env"]
    first_line = (root / "benches" / "ttft_bench.py").read_text().splitlines()[0]
    assert first_line.startswith("# TTFT")
