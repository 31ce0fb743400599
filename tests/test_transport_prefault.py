"""The registered pool's first bytes are faulted in when it is made (issue 47: a first touch of
fresh pages cost 0.72 s for 179 MB inside the first request that used them), the rest stays lazy."""
from __future__ import annotations

import pytest

from kvtransport.transfer.buffer_pool import BufferPool


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


def test_prefault_makes_the_pools_first_bytes_resident_and_leaves_the_rest_lazy():
    before = _rss()
    lazy = BufferPool(256 << 20)
    mid = _rss()
    warm = BufferPool(256 << 20, prefault_bytes=96 << 20)
    after = _rss()
    assert mid - before < 16 << 20                      # nothing touched without prefault
    assert 80 << 20 < after - mid < 160 << 20           # the 96 MiB asked for, not the whole 256
    assert lazy.lease(1 << 20) is not None and warm.lease(1 << 20) is not None


def test_prefault_setting_is_checked():
    from kvtransport.transfer.nixl_transport import NixlTransportConfig
    with pytest.raises(ValueError, match="prefault_bytes"):
        NixlTransportConfig(prefault_bytes=-1)
    with pytest.raises(ValueError, match="prefault_bytes"):
        BufferPool(1 << 20, prefault_bytes=-1)
    assert NixlTransportConfig().prefault_bytes == 512 << 20
