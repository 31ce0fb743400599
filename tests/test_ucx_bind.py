"""UCX (NIXL's backend) is kept on the network device that holds kvnotes' listen address
(issue 45, item 7): loopback -> ``lo``, this host's own address -> its device, an operator's
``UCX_NET_DEVICES`` kept, an address no device holds left alone and said."""
from __future__ import annotations

import socket

import psutil

from kvtransport.transfer.options import confine_ucx, ucx_device


def test_ucx_listens_on_the_device_of_the_bind_address(monkeypatch, caplog):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert confine_ucx("127.0.0.1") == "lo"
    own = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for name, addr in own:
        monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
        assert confine_ucx(addr) == name
        import os
        assert os.environ["UCX_NET_DEVICES"] == name
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    assert confine_ucx("127.0.0.1") == "mlx5_0:1"                  # the operator's choice stays
    monkeypatch.delenv("UCX_NET_DEVICES")
    with caplog.at_level("WARNING"):
        assert confine_ucx("203.0.113.77") is None                 # TEST-NET-3: no device here holds it
    assert "203.0.113.77" in caplog.text and ucx_device("not-an-ip") is None
