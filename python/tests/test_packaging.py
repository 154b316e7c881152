"""What an operator installs besides the wheel: the systemd unit (systemd-analyze verify), the example manager.toml
(every flag, every value accepted), and the Grafana dashboard with its Prometheus job: every series the dashboard
queries exists on the Manager it belongs to (a standalone Manager with its SSD tier for the engine-side rows, a
distributed Manager that has fetched a prefix from a peer for the cluster row)."""

import json
import os
import re
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import yaml

import orbitkv
from orbitkv import shm
from cluster_procs import distributed_managers, free_port, wait_catalogs_hold_every_block
from vllm_harness.manager import ManagerProcess

PACKAGING = os.path.join(os.path.dirname(__file__), "..", "..", "packaging")
UNIT = os.path.join(PACKAGING, "systemd", "orbitkv-manager.service")
TOML = os.path.join(PACKAGING, "config", "manager.toml")
DASHBOARD = os.path.join(PACKAGING, "grafana", "orbitkv.json")
PROMETHEUS = os.path.join(PACKAGING, "prometheus", "prometheus.yml")
INSTALLED = "/usr/local/bin/orbitkv-manager"


@pytest.fixture(scope="module")
def manager_binary(build_dir):
    return str(build_dir / "src" / "server" / "orbitkv-manager")


def test_the_service_unit_verifies_and_keeps_what_the_manager_needs(manager_binary, tmp_path):
    text = open(UNIT).read()
    for directive in ("LimitMEMLOCK=infinity", "RuntimeDirectory=orbitkv", "KillSignal=SIGTERM",
                      f"ExecStart={INSTALLED} --config /etc/orbitkv/manager.toml"):
        assert directive in text, directive
    # The graceful stop writes DRAM blocks to SSD for up to ssd-persist-on-exit (30 s by default): the unit waits
    # longer than that before it kills.
    timeout = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1))
    assert timeout > 30
    # systemd-analyze checks that ExecStart's program exists: the unit as installed, with the built Manager where
    # pip's console script would be linked.
    unit = tmp_path / "orbitkv-manager.service"
    unit.write_text(text.replace(INSTALLED, manager_binary))
    checked = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stderr.strip() == "", checked.stderr
    # A unit that names a program that is not there fails the same check (the check is real).
    broken = tmp_path / "broken.service"
    broken.write_text(text.replace(INSTALLED, str(tmp_path / "missing")))
    assert subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True).returncode != 0


def flags_of(manager_binary):
    help_text = subprocess.run([manager_binary, "--help"], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"^  --([a-z-]+)", help_text, re.M)) - {"config", "check-config", "version", "help"}


def test_the_example_config_names_every_flag_and_every_value_is_accepted(manager_binary, tmp_path):
    text = open(TOML).read()
    keys = set(re.findall(r"^(?:# )?([a-z-]+) = ", text, re.M))
    assert keys == flags_of(manager_binary)
    shipped = subprocess.run([manager_binary, "--config", TOML, "--check-config"], capture_output=True, text=True)
    assert shipped.returncode == 0, shipped.stderr
    assert "socket /run/orbitkv/manager.sock" in shipped.stdout
    everything = tmp_path / "all.toml"
    everything.write_text(re.sub(r"^# ([a-z-]+ = )", r"\1", text, flags=re.M))
    checked = subprocess.run([manager_binary, "--config", str(everything), "--check-config"], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stderr
    assert "cluster prod via" in checked.stdout and "ssd /var/lib/orbitkv/ssd" in checked.stdout
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(text.replace('# dram = "64GiB"', 'dram = "lots"'))
    refused = subprocess.run([manager_binary, "--config", str(wrong), "--check-config"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "dram" in refused.stderr


# ---- the dashboard ----------------------------------------------------------------------------------------------

SELECTOR = re.compile(r"\b((?:orbitkv|transfer)_[a-z0-9_]+)(\{[^}]*\})?")
RANGE_FUNCTION = re.compile(r"\b(rate|increase|irate)\((orbitkv_[a-z0-9_]+)")


def dashboard_queries():
    """(row title, expr) of every target, in order."""
    dashboard = json.load(open(DASHBOARD))
    row, out = None, []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel["targets"]:
            out.append((row, target["expr"]))
    return out


def samples(text):
    """{metric name: [labels dict]} of a Prometheus exposition; TYPE of each family."""
    series, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ", line)
        labels = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', match.group(3) or ""))
        series.setdefault(match.group(1), []).append(labels)
    return series, types


def missing_series(exprs, text):
    series, _ = samples(text)
    missing = []
    for expr in exprs:
        for name, matchers in SELECTOR.findall(expr):
            wanted = dict(re.findall(r'([a-z_]+)="([^"]*)"', matchers))  # exact matchers only (not instance=~)
            if not any(all(labels.get(k) == v for k, v in wanted.items()) for labels in series.get(name, [])):
                missing.append(f"{name}{matchers}")
    return missing


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


NS_ARGS = ("dash/model", "main", "dash/tok", "cpu")
SHAPE = (16, 16, 2, 64)


def engine(manager, instance=1):
    client = orbitkv.CacheManagerClient(manager.socket)
    ns = orbitkv.derive_namespace(*NS_ARGS, dtype="bf16", page_size_tokens=16)
    client.register_instance(instance, ns)
    caches = [shm.empty(SHAPE, "uint16") for _ in range(4)]
    client.register_group(instance, 0, caches)
    keys = [orbitkv.StateKey(ns, 0, i * 16, i * 16 + 16, i.to_bytes(16, "little")) for i in range(8)]
    return client, caches, keys


def save_and_restore(manager):
    client, caches, keys = engine(manager)
    for cache in caches:
        cache[...] = np.arange(cache.size, dtype=np.uint16).reshape(cache.shape)
    assert client.save(1, [(k, i) for i, k in enumerate(keys[:6])]) == (6, 0)
    hit = client.query_prefetch(1, keys)
    assert isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 6
    client.restore(1, hit.lease, range(6))
    return client


def test_the_prometheus_job_scrapes_the_managers_metrics_path():
    config = yaml.safe_load(open(PROMETHEUS))
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "orbitkv")
    assert job["metrics_path"] == "/metrics"
    assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in job["static_configs"][0]["targets"])


def test_every_series_the_dashboard_queries_exists_on_the_manager_it_belongs_to(manager_binary, tmp_path):
    queries = dashboard_queries()
    cluster = [e for row, e in queries if row.startswith("Cluster")]
    engine_side = [e for row, e in queries if not row.startswith("Cluster")]
    assert len(cluster) >= 10 and len(engine_side) >= 20
    titles = {p["title"] for p in json.load(open(DASHBOARD))["panels"]}
    for wanted in ("Hit rate by tier", "Restored and saved (GB/s)", "Query latency", "Restore latency",
                   "DRAM pool occupancy", "SSD occupancy", "Evictions and SSD write-back", "Budget waits",
                   "Loading operations", "Membership", "Catalog", "Remote fetch (GB/s)"):
        assert wanted in titles, wanted

    # Standalone, with the SSD tier on: every engine-side series; the cluster row stays empty there.
    port = free_port()
    standalone = ManagerProcess(manager_binary, extra=("--metrics-addr", f"127.0.0.1:{port}", "--ssd-path",
                                                       str(tmp_path / "ssd"), "--ssd-capacity", "64MiB"))
    try:
        save_and_restore(standalone)
        text = scrape(port)
    finally:
        standalone.stop()
    assert missing_series(engine_side, text) == []
    assert missing_series(cluster, text) != []  # the cluster row belongs to distributed Managers only
    _, types = samples(text)
    # rate() and increase() only over counters and histogram buckets.
    for _, expr in queries:
        for _, name in RANGE_FUNCTION.findall(expr):
            family = name[: -len("_bucket")] if name.endswith("_bucket") else name
            assert types.get(family, "counter") in ("counter", "histogram"), f"{name} is a {types.get(family)}"
    assert types["orbitkv_query_hit_blocks_total"] == "counter"

    # Two distributed Managers: B fetches A's prefix, then every series of every row is on B.
    ports = []

    def start(flags):
        ports.append(free_port())
        return ManagerProcess(manager_binary, extra=(*flags, "--metrics-addr", f"127.0.0.1:{ports[-1]}", "--ssd-path",
                                                     str(tmp_path / f"ssd{len(ports)}"), "--ssd-capacity", "64MiB"))

    with distributed_managers(start) as (a, b):
        client_a, caches_a, keys = engine(a)
        for cache in caches_a:
            cache[...] = np.arange(cache.size, dtype=np.uint16).reshape(cache.shape) ^ 0x5A5A
        assert client_a.save(1, [(k, i) for i, k in enumerate(keys)]) == (8, 0)
        wait_catalogs_hold_every_block([a, b])
        client_b, caches_b, _ = engine(b)
        for cache in caches_b:
            cache[...] = 0xDEAD
        deadline = time.monotonic() + 30
        hit = client_b.query_prefetch(1, keys, wait=10)
        while not (isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 8) and time.monotonic() < deadline:
            if isinstance(hit, orbitkv.QueryHit):
                client_b.release(1, hit.lease)
            time.sleep(0.1)
            hit = client_b.query_prefetch(1, keys, wait=10)
        assert isinstance(hit, orbitkv.QueryHit) and hit.num_hit_blocks == 8, hit
        client_b.restore(1, hit.lease, range(8))
        for got, want in zip(caches_b, caches_a):
            assert np.array_equal(got[:8], want[:8])
        text_b = scrape(ports[1])
    assert missing_series(engine_side + cluster, text_b) == []
    values = {}
    for line in text_b.splitlines():
        match = re.match(r'orbitkv_query_hit_blocks_total\{tier="(\w+)"\} (\d+)', line)
        if match:
            values[match.group(1)] = int(match.group(2))
    assert values.get("remote") == 8, values  # the hit-rate panel's remote tier counts the fetched prefix


def test_a_gpu_list_naming_a_missing_gpu_stops_the_manager_with_the_fix(manager_binary, tmp_path):
    # GPU 99 exists nowhere: without a GPU the Manager says none is usable, with GPUs how many are visible.
    started = subprocess.run([manager_binary, "--socket", str(tmp_path / "m.sock"), "--dram", "64MiB", "--gpus",
                              "99"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 1
    assert "--gpus names GPU" in started.stderr and ("--gpus none" in started.stderr or "visible" in started.stderr)
