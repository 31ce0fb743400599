"""The gRPC transport's typed config (:class:`GrpcTransportConfig`: limits, tuning, checksum
policy, TLS; both ends build their channel/server arguments and credentials from it) and the
process-wide malloc tuning it names (:func:`tune_malloc`). Imported by ``grpc_transport`` and
``options``; nothing here opens a socket."""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrpcTransportConfig:
    chunk_bytes: int = 1 << 20            # payload bytes per stream message (1-8 MiB measured alike; 1 MiB)
    max_message_bytes: int = 8 << 20      # gRPC send/receive limit (must exceed chunk + header)
    max_block_bytes: int = 2 << 30        # a larger block is refused before its payload arrives
    inbox_bytes: int = 4 << 30            # in-flight + verified-but-unclaimed bytes before refusing pushes
    unclaimed_ttl_s: float = 300.0        # an unclaimed block is dropped after this long
    workers: int = 8                      # server threads (concurrent pushes)
    pool_bytes: int = 1 << 30             # receive arena (virtual until used; pages stay warm)
    require_grant: bool = False           # accept only transfers announced by expect() (the cluster: True)
    # glibc malloc: keep up to this many freed bytes in the heap (and serve allocations up to 32 MiB
    # from it) so gRPC's per-message buffers reuse warm pages instead of page-faulting fresh ones
    # (measured 0.75 -> 1.0-1.15 GB/s at 180 MiB); process-wide, set once; 0 leaves glibc's defaults
    malloc_keep_bytes: int = 256 << 20
    # CRC-32C of each chunk on one CRC thread per transport (sender's send_kv and receiver),
    # overlapping the stream (libcrc32c releases the GIL); False: in line, right after the chunk's
    # copy (in cache). On 2 cores in line measured faster (1.26-1.32 vs 0.91-0.99 GB/s at 180 MiB:
    # a hand-off per 1 MiB chunk costs more CPU than the overlap saves; docs/benchmarks.md)
    crc_thread: bool = False
    # HTTP/2 SETTINGS_MAX_FRAME_SIZE this side advertises (16 KiB .. 16 MiB - 1; 0: gRPC's default,
    # 16 KiB): larger DATA frames from the peer mean fewer slices per message to join
    http2_max_frame_bytes: int = 0
    # gRPC's TCP read buffer size hint (grpc.experimental.tcp_read_chunk_size; 0: gRPC's default)
    tcp_read_chunk_bytes: int = 0
    # HTTP/2 stream flow-control lookahead (grpc.http2.lookahead_bytes: how far a sender may run
    # ahead of the receiver's reads; 0: gRPC's default, 64 KiB, grown by BDP probing)
    http2_lookahead_bytes: int = 0
    # "auto": no CRC-32C for a same-host peer (send_kv sends such blocks unchecked; the receiver
    # takes unchecked blocks only from its own host); "always": every block is CRC-checked
    checksum: str = "auto"
    # a stream must send its header within this many seconds, at most this many streams of one host (and
    # of all hosts) wait for theirs; the server runs workers + max_waiting_streams threads
    # (kvtransport.transfer.stream_watch: idle streams cannot hold the inbox)
    first_message_timeout_s: float = 2.0
    max_waiting_streams_per_peer: int = 4
    max_waiting_streams: int = 32
    # TLS (across hosts): the server presents tls_cert_file / tls_key_file; senders verify it against
    # tls_ca_file (tls_server_name: the name the certificate carries, when not the dialled host), and
    # with tls_client_auth the server requires the senders' certificate too (the same files on every actor)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_server_name: str = ""
    tls_client_auth: bool = True

    def __post_init__(self):
        if self.checksum not in ("auto", "always"):
            raise ValueError(f"checksum must be 'auto' or 'always', got {self.checksum!r}")
        if self.chunk_bytes <= 0 or self.max_message_bytes < self.chunk_bytes + (1 << 20):
            raise ValueError("max_message_bytes must exceed chunk_bytes by at least 1 MiB of header room")
        if self.pool_bytes < 0 or self.malloc_keep_bytes < 0:
            raise ValueError("pool_bytes and malloc_keep_bytes must be >= 0 (0: no pool / glibc defaults)")
        if self.http2_max_frame_bytes and not (1 << 14) <= self.http2_max_frame_bytes < (1 << 24):
            raise ValueError("http2_max_frame_bytes must be 0 (default) or in [16384, 16777215] (HTTP/2 limits)")
        if self.tcp_read_chunk_bytes < 0 or self.http2_lookahead_bytes < 0:
            raise ValueError("tcp_read_chunk_bytes and http2_lookahead_bytes must be >= 0 (0: gRPC's default)")
        if self.first_message_timeout_s <= 0 or not 1 <= self.max_waiting_streams_per_peer <= self.max_waiting_streams:
            raise ValueError("first_message_timeout_s must be > 0 and 1 <= max_waiting_streams_per_peer <= "
                             "max_waiting_streams")
        if bool(self.tls_cert_file) != bool(self.tls_key_file) or (self.tls_cert_file and not self.tls_ca_file):
            raise ValueError("TLS needs tls_cert_file, tls_key_file and tls_ca_file together (or none of them)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def _read(self, name: str) -> bytes:
        from pathlib import Path
        path = getattr(self, name)
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None

    def server_credentials(self):
        """gRPC server credentials for TLS (None: plain)."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self._read("tls_key_file"), self._read("tls_cert_file"))],
                                           root_certificates=self._read("tls_ca_file"),
                                           require_client_auth=self.tls_client_auth)

    def channel_credentials(self):
        """gRPC channel credentials for TLS (None: plain): the CA, and this actor's own certificate."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self._read("tls_ca_file"),
                                            private_key=self._read("tls_key_file"),
                                            certificate_chain=self._read("tls_cert_file"))

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel/server arguments for this config (both ends use them)."""
        opts = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        if self.http2_max_frame_bytes:
            opts.append(("grpc.http2.max_frame_size", self.http2_max_frame_bytes))
        if self.http2_lookahead_bytes:
            opts.append(("grpc.http2.lookahead_bytes", self.http2_lookahead_bytes))
        if self.tcp_read_chunk_bytes:
            opts += [("grpc.experimental.tcp_read_chunk_size", self.tcp_read_chunk_bytes),
                     ("grpc.experimental.tcp_max_read_chunk_size", max(self.tcp_read_chunk_bytes, 4 << 20))]
        return opts


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # mallopt(3) parameters
_malloc_tuned = False


def tune_malloc(keep_bytes: int) -> bool:
    """Once per process: glibc ``mallopt`` so that freed message buffers stay in the heap (trim
    threshold ``keep_bytes``) and allocations up to 32 MiB (glibc's maximum mmap threshold) come
    from it, warm, instead of a fresh ``mmap`` that page-faults per 4 KiB. Returns whether it
    applied (False: not glibc, ``keep_bytes`` 0, or already done); logged."""
    global _malloc_tuned
    if _malloc_tuned or keep_bytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, keep_bytes) == 1
    except (OSError, AttributeError):  # not glibc (musl, macOS): defaults stay, logged
        ok = False
    _malloc_tuned = True
    log.info("gRPC transport: malloc keeps up to %d freed bytes warm: %s", keep_bytes, "applied" if ok else "unavailable")
    return ok

