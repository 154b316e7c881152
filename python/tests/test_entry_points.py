"""The entry points reviewers rely on: the benchmark JSON contract, scripts/bench --list, and the demo that
scripts/run shows."""

import json
import math
import re
import subprocess

import orbitkv


def test_state_bench_json_contract(build_dir):
    exe = build_dir / "benches" / "state_bench"
    out = subprocess.run([str(exe), "--json"], check=True, capture_output=True, text=True, timeout=300).stdout
    report = json.loads(out)
    assert report["bench"] == "state"
    assert set(report["env"]) >= {"host", "cpus", "build"}
    metrics = {r["metric"]: r for r in report["results"]}
    assert {"shard_of_keys_per_s", "key_encode_decode_per_s", "metrics_counter_increments_per_s"} <= set(metrics)
    for r in report["results"]:
        assert set(r) == {"metric", "unit", "value", "baseline_metric", "baseline", "ratio"}
        assert r["value"] > 0 and r["baseline"] > 0
        assert math.isclose(r["ratio"], r["value"] / r["baseline"], rel_tol=1e-9)


def test_bench_script_lists_and_rejects(root):
    listed = subprocess.run([str(root / "scripts" / "bench"), "--list"], check=True, capture_output=True,
                            text=True).stdout
    names = [line.split()[0] for line in listed.splitlines()]
    assert {"core", "state"} <= set(names)
    bad = subprocess.run([str(root / "scripts" / "bench"), "no-such-bench"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "no benchmark 'no-such-bench'" in bad.stderr


def test_demo_boundary_agrees_with_bindings(build_dir):
    out = subprocess.run([str(build_dir / "tools" / "orbitkv-state-demo")], check=True, capture_output=True,
                         text=True).stdout
    lines = {line.split(":")[0].strip(): line.split(":", 1)[1].split() for line in out.splitlines()
             if line.startswith(("rank 0:", "rank 1:", "both  :"))}
    rank0 = [int(x) for x in lines["rank 0"]]
    rank1 = [int(x) for x in lines["rank 1"]]
    assert [int(x) for x in lines["both"]] == orbitkv.intersect_boundaries([rank0, rank1])
    assert f"Chosen boundary: {orbitkv.intersect_boundaries([rank0, rank1])[-1]} tokens" in out


def test_demo_rejects_bad_flags(build_dir):
    bad = subprocess.run([str(build_dir / "tools" / "orbitkv-state-demo"), "--tokens", "abc"], capture_output=True,
                         text=True)
    assert bad.returncode == 2
    assert "positive integer" in bad.stderr


def test_cache_demo_serves_a_workload_and_verifies_every_restore(build_dir):
    out = subprocess.run([str(build_dir / "tools" / "orbitkv-cache-demo"), "--requests", "300", "--pool-mib", "32",
                          "--allow-unpinned", "--metrics"], check=True, capture_output=True, text=True,
                         timeout=300).stdout
    # "  label words      value..." lines: the label ends at the first run of two spaces.
    fields = {}
    for line in out.splitlines():
        match = re.match(r"  (\S.*?)\s{2,}(.*)", line)
        if match:
            fields[match.group(1)] = match.group(2)
    assert fields["corrupted restores"].split()[-1] == "0"
    hit = int(fields["pages asked / hit"].split("/")[1].split()[0])
    assert hit > 0
    # A 32 MiB pool cannot hold the working set: eviction and admission both had work to do.
    assert int(fields["evictions"].split()[-1]) > 0
    assert "orbitkv_cache_hits_total" in out and "orbitkv_leases_active 0" in out


def test_cache_demo_rejects_bad_flags(build_dir):
    exe = str(build_dir / "tools" / "orbitkv-cache-demo")
    bad = subprocess.run([exe, "--requests", "abc"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "positive integer" in bad.stderr
    unknown = subprocess.run([exe, "--frobnicate"], capture_output=True, text=True)
    assert unknown.returncode == 2
    assert "unknown option" in unknown.stderr
