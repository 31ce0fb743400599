"""The deploy/ files stay true to the code: configs load, the dashboard is the generated one
and queries only metrics the router exports."""
import json
import re
from pathlib import Path

import yaml

from cluster.config import ClusterConfig
from cluster.dashboard import dashboard
from cluster.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent


def test_example_serve_config_loads():
    cfg = ClusterConfig.from_file(ROOT / "deploy" / "kvnotes.yaml")
    assert cfg.prefill.count == 2 and cfg.prefill.custom_resource and cfg.ray_address == "auto"


def test_ray_up_yaml_has_what_ray_up_needs():
    c = yaml.safe_load((ROOT / "deploy" / "cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "auth", "setup_commands", "head_start_ray_commands",
                "worker_start_ray_commands"):
        assert key in c
    assert any("prefill" in cmd for cmd in c["worker_start_ray_commands"])


def test_dashboard_file_is_generated_and_uses_exported_metrics():
    on_disk = json.loads((ROOT / "deploy" / "grafana" / "kvnotes.json").read_text())
    assert on_disk == dashboard(), "regenerate: python -m cluster.dashboard > deploy/grafana/kvnotes.json"
    exported = {m.name for m in Metrics().registry.collect()}
    for panel in on_disk["panels"]:
        for t in panel["targets"]:
            for name in re.findall(r"kvnotes_[a-z_]+", t["expr"]):
                base = re.sub(r"_(bucket|count|sum|total)$", "", name)
                assert base in exported, f"{panel['title']}: {name} is not exported"


def test_bad_config_is_a_clear_error(tmp_path):
    import pytest
    p = tmp_path / "c.yaml"
    p.write_text("model: smollm2-135m\nprefil: {count: 1}\n")
    with pytest.raises(ValueError, match="unknown config key"):
        ClusterConfig.from_file(p)
    p.write_text("default_policy: turbo\n")
    with pytest.raises(ValueError, match="default_policy"):
        ClusterConfig.from_file(p)
    with pytest.raises(ValueError, match="does not exist"):
        ClusterConfig.from_file(tmp_path / "missing.yaml")
