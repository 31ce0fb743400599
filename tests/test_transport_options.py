"""Transport tuning from the cluster config (``kv_grpc`` / ``kv_nixl``): the keys reach the real
transports a decode actor builds, bad keys and values are one clear error before anything
starts, and the grant requirement is not a setting."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kvruntime.kv import KVCache
from kvruntime.config import ClusterConfig
from kvruntime.messages.transfer import TransferGrant
from kvtransport.transfer.blocks import encode_block
from kvtransport.transfer.endpoints import Receiver
from kvtransport.transfer.grpc_transport import GrpcTransport
from kvtransport.transfer.options import check, grpc_config, nixl_config
from kvtransport.transfer.interface import TransferError

ROOT = Path(__file__).resolve().parent.parent


def test_yaml_mappings_become_the_transports_configs():
    cfg = ClusterConfig.from_dict({"kv_grpc": {"inbox_bytes": 1 << 20, "max_block_bytes": 300_000},
                                   "kv_nixl": {"pool_bytes": 64 << 20, "ucx_error_handling": "none",
                                               "backends": ["UCX"]}})
    g, n = grpc_config(cfg), nixl_config(cfg)
    assert (g.inbox_bytes, g.max_block_bytes, g.require_grant) == (1 << 20, 300_000, True)
    assert (n.pool_bytes, n.ucx_error_handling, n.backends, n.require_grant) == (64 << 20, "none", ("UCX",), True)
    assert hash(cfg) == hash(ClusterConfig.from_dict({"kv_grpc": {"max_block_bytes": 300_000, "inbox_bytes": 1 << 20},
                                                      "kv_nixl": {"backends": ["UCX"], "ucx_error_handling": "none",
                                                                  "pool_bytes": 64 << 20}}))
    d = ClusterConfig()
    assert grpc_config(d).inbox_bytes == 4 << 30 and grpc_config(d).require_grant    # defaults: the classes'
    assert grpc_config(d).checksum == "auto"
    assert grpc_config(ClusterConfig.from_dict({"kv_grpc": {"checksum": "always"}})).checksum == "always"


@pytest.mark.parametrize("section, options, message", [
    ("kv_grpc", {"inbox_byte": 1}, "kv_grpc: unknown option 'inbox_byte'"),
    ("kv_nixl", {"ucx_error_handling": "bogus"}, "kv_nixl: "),
    ("kv_grpc", {"chunk_bytes": 64 << 20}, "kv_grpc: max_message_bytes must exceed chunk_bytes"),
    ("kv_grpc", {"require_grant": False}, "kv_grpc: require_grant is not a setting"),
    ("kv_grpc", {"checksum": "never"}, "kv_grpc: checksum must be 'auto' or 'always', got 'never'"),
    ("kv_nixl", {"require_grant": False}, "kv_nixl: require_grant is not a setting"),
])
def test_bad_options_are_one_clear_error(section, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check(ClusterConfig.from_dict({section: options}))


def test_a_non_mapping_is_refused_at_load():
    with pytest.raises(ValueError, match="kv_grpc must be a mapping"):
        ClusterConfig.from_dict({"kv_grpc": 5})
    with pytest.raises(ValueError, match="kv_nixl: option 'pool_bytes' must be"):
        ClusterConfig.from_dict({"kv_nixl": {"pool_bytes": {"a": 1}}})


def test_the_decode_receiver_runs_with_the_configured_limits():
    """A decode actor's Receiver, built as the actor builds it: the configured max_block_bytes
    refuses a granted block one byte too large, before its payload is taken."""
    cfg = ClusterConfig.from_dict({"kv_transport": "grpc", "kv_grpc": {"max_block_bytes": 40 * 1024,
                                                                       "pool_bytes": 8 << 20}})
    rx = Receiver("grpc", "m", "float32", bind="127.0.0.1", advertise="127.0.0.1", grpc_cfg=grpc_config(cfg),
                  nixl_cfg=nixl_config(cfg))
    tx = GrpcTransport()
    try:
        for tokens, want in ((40, None), (41, "too_large")):        # 40 tokens x 1 KiB fits exactly
            kv = KVCache(torch.randn(2, 2, 2, tokens, 32), torch.arange(tokens), torch.arange(tokens))
            grant, cred = TransferGrant.issue(f"t{tokens}", "m", "float32", kv.token_ids.tolist(), 0)
            rx.expect(grant)
            try:
                tx.send(rx.endpoint.grpc_address, encode_block(f"t{tokens}", "m", kv, credential=cred), timeout=10)
                got = None
            except TransferError as exc:
                got = exc.reason
            assert got == want, (tokens, got)
        assert rx.stats().held_bytes == 40 * 1024
    finally:
        tx.stop()
        rx.stop()


def test_serve_with_a_bad_option_exits_with_one_line_before_starting_anything(tmp_path):
    cfg = tmp_path / "kvnotes.yaml"
    cfg.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "kv_nixl": {"pool_byte": 1}}))
    r = subprocess.run([sys.executable, "-c", "import sys; from cluster.operator.cli import main; sys.exit(main())",
                        "serve", "--config", str(cfg)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("kvnotes: error:")]
    assert len(err) == 1 and "kv_nixl: unknown option 'pool_byte'" in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Started a local Ray instance" not in r.stderr + r.stdout
    assert not (tmp_path / "data").exists()                     # nothing was started or written
