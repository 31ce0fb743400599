"""KV transfer between two Ray actors on this machine: NIXL, gRPC and a plain memory copy (the
limit), side by side in one run.

    python -m bench.transfer [--mib 45,180,360] [--reps 5] [--transports nixl,grpc] [--json]
                             [--grpc-config '{"chunk_bytes": 4194304}']

KV is synthetic fp32 with SmolLM2-135M's shape (30 layers, 3 KV heads, head dim 64: 45 MiB per
1024 tokens). Each transport runs in two actors (a share of Ray's 2 CPUs small enough that all
fit): a sender and a receiver holding one transport object each, metadata/addresses passed
through the actor handles. One measurement is the whole path the executors run: the row's send
on the sender (returns once the receiver has verified the block), then ``receive`` +
``decode_block`` on the receiver; GB/s = 1e9 bytes/s over their sum, median of ``--reps`` after
one untimed warm-up (which faults in the pools' pages). Repetitions are interleaved (rep 1 of
every transport, then rep 2, ...), so a slow spell of a shared VM hits every row alike and the
ratios between rows stay fair. ``--ucx-error-handling none`` runs the NIXL rows with that
``NixlTransportConfig`` setting (see there). ``nixl`` is exactly what the cluster runs: the
sender's KV is built in a lease of its ``endpoints.Sender``'s registered pool (``Sender.alloc``,
where the prefill executor builds the prefix it will ship over NIXL) and ``Sender.send`` ships
it without a copy (``NixlTransport.send_kv``: each piece CRC-32C'd and announced, the receiver
READs it while the next is CRC'd; the row records ``zero_copy`` true only if nothing was
staged); its encode column is the header (``serialise``). ``nixl-copy`` is the same ``Sender``
with the KV in ordinary memory (what the cluster runs when the prefix is not built in the pool:
a cast to the engine's dtype, a partial send, a full pool): copied into the pool piece by piece
while the receiver READs. ``nixl-serial`` encodes into the registered pool first
(``encode_block(..., into=transport.lease)``: copy + CRC in one pass), then sends;
``nixl-staged`` is the plain ``encode_block`` (send stages a copy). ``grpc`` is what the
cluster's ``Sender`` runs over gRPC (``block_header`` + ``GrpcTransport.send_kv``; its encode
column is the header) under the config's checksum policy: by default ``auto``, so between these
two actors of one host the block goes unchecked. ``grpc-crc`` is the same ``Sender`` with
``checksum: always`` on both ends: each 1 MiB chunk CRC-32C'd right after it is framed, the CRC
sent last and checked by the receiver, which is what every push between two hosts pays. Each
gRPC row records ``checksum`` (``crc32c`` or ``none``: what the receiver saw). ``grpc-raw`` is
the ceiling of gRPC's Python API here (:class:`RawGrpc`: the same bytes, no header, checksum,
inbox or grant); the ``grpc`` rows carry ``of_grpc_raw``, their share of it measured in the same
run. ``--grpc-config`` overrides ``GrpcTransportConfig`` fields of both gRPC ends (a JSON
object; for A/B runs; ``grpc-crc`` keeps ``checksum: always``). As in the cluster, every
transfer is authenticated: the driver gives the receiver a grant (``expect``) before the push and the block carries the
transfer's credential (receivers run with ``require_grant``). ``send_gbps`` is the send alone;
``tx_cpu_ns_b`` / ``rx_cpu_ns_b`` are the CPU seconds (all threads) the sender / receiver actor
spent per byte over one measurement, median (CPU is the scarce thing on a small box, and it is
steadier than wall time when the machine is shared). ``copy_gbps`` is ``Tensor.copy_`` of the
same bytes into a warm preallocated tensor inside the sender actor, median of ``--reps``. One
progress line per measurement goes to stderr; ``--json`` prints one JSON object per line to
stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

LAYERS, KV_HEADS, HEAD_DIM, MODEL = 30, 3, 64, "smollm2-135m"
NIXL_KINDS = ("nixl", "nixl-copy", "nixl-serial", "nixl-staged")
GRPC_KINDS = ("grpc", "grpc-crc", "grpc-raw")
RAW_METHOD = "/kvnotes.bench.Raw/Push"


class RawGrpc:
    """The ceiling of gRPC's Python API on this machine, for the ``grpc-raw`` row: the same bytes
    as a bare stream of ``chunk_bytes`` ``bytes`` messages (one copy each, like the transport's
    framing) into a stream-unary handler that copies each message into one preallocated, warm
    array (like the transport's receive pool), in processes with the transport's malloc setting.
    No header, no CRC-32C, no inbox, no grant: what is left is gRPC itself, so ``grpc`` /
    ``grpc-raw`` is the share of that ceiling the transport reaches."""

    def __init__(self, cfg):
        import threading
        from kvtransport.transfer.grpc_transport import tune_malloc
        tune_malloc(cfg.malloc_keep_bytes)          # the same process setting as the transport's ends
        self.cfg, self.got, self.dest, self.server = cfg, {}, None, None
        self.cv = threading.Condition()
        self.channels = {}

    def serve(self) -> str:
        import grpc
        from concurrent import futures
        import numpy as np

        def push(requests, context):
            tid, got = dict(context.invocation_metadata()).get("tid", ""), 0
            for m in requests:
                n = len(m)
                if self.dest is None or got + n > len(self.dest):       # sized (and warmed) by the warm-up push
                    self.dest = np.empty(max(2 * (got + n), 1 << 20), np.uint8)   # contents are never read
                self.dest[got:got + n] = np.frombuffer(m, np.uint8)
                got += n
            with self.cv:
                self.got[tid] = got
                self.cv.notify_all()
            return b""

        handler = grpc.method_handlers_generic_handler(
            "kvnotes.bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=self.cfg.channel_options())
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return f"127.0.0.1:{port}"

    def expect(self, grant) -> None:
        """No trust model on the ceiling row: nothing to announce."""

    def send(self, address: str, tid: str, payload) -> None:
        import grpc
        ch = self.channels.get(address) or self.channels.setdefault(
            address, grpc.insecure_channel(address, options=self.cfg.channel_options()))
        view, step = memoryview(payload).cast("B"), self.cfg.chunk_bytes
        ch.stream_unary(RAW_METHOD)((bytes(view[s:s + step]) for s in range(0, len(view), step)),
                                    metadata=(("tid", tid),), timeout=120)

    def receive(self, tid: str, timeout: float) -> int:
        with self.cv:
            if not self.cv.wait_for(lambda: tid in self.got, timeout):
                raise TimeoutError(f"{tid} not received in {timeout} s")
            return self.got.pop(tid)

    def stop(self) -> None:
        for ch in self.channels.values():
            ch.close()
        if self.server is not None:
            self.server.stop(1).wait()


def _tokens(mib: int) -> int:
    return mib * 2**20 // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 4)


class Endpoint:
    """One side of one transport, inside a Ray actor. Holds at most one KV tensor."""

    def __init__(self, kind: str, ucx_error_handling: str = "peer", grpc_config: dict | None = None):
        import logging
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.kind, self.kv, self.received = kind, None, 0
        if kind == "grpc-raw":
            from kvtransport.transfer.grpc_transport import GrpcTransportConfig
            self.t = RawGrpc(GrpcTransportConfig(**(grpc_config or {})))
        elif kind in GRPC_KINDS:
            from kvtransport.transfer.endpoints import Sender
            from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
            cfg = GrpcTransportConfig(**{"require_grant": True, **(grpc_config or {}),
                                         **({"checksum": "always"} if kind == "grpc-crc" else {})})
            self.s = Sender("grpc", grpc_cfg=cfg)                   # the cluster's prefill side
            self.t = GrpcTransport(cfg, model=MODEL)               # the decode side
        elif kind in NIXL_KINDS:
            from kvtransport.transfer.nixl_transport import NixlTransport, NixlTransportConfig
            cfg = NixlTransportConfig(require_grant=True, ucx_error_handling=ucx_error_handling)
            if kind in ("nixl", "nixl-copy"):                      # the cluster's prefill side (a receiver too)
                from kvtransport.transfer.endpoints import Sender
                self.s = Sender("nixl", cfg)
                self.t = self.s.nixl
                self.t.model = MODEL
            else:
                self.t = NixlTransport(cfg, model=MODEL)
        elif kind != "copy":
            raise ValueError(f"unknown transport {kind!r}; choose {', '.join(NIXL_KINDS + GRPC_KINDS)} or copy")

    def address(self):
        """gRPC: serve and return host:port; NIXL: (agent name, metadata)."""
        if self.kind == "grpc-raw":
            return self.t.serve()
        if self.kind in GRPC_KINDS:
            return self.t.serve("127.0.0.1", 0)
        return self.t.name, self.t.metadata()

    def add_peer(self, name: str, metadata: bytes) -> str:
        return self.t.add_peer(name, metadata)

    def grant(self, tid: str) -> tuple:
        """(Sender) a grant for ``tid`` over the KV it holds and its credential."""
        from kvruntime.messages.transfer import TransferGrant
        return TransferGrant.issue(tid, MODEL, "float32", self.kv.token_ids.tolist())

    def expect(self, grant) -> None:
        self.t.expect(grant)

    def make(self, mib: int) -> int:
        from kvruntime.kv import KVCache
        n = _tokens(mib)
        self.kv = None
        g, shape = torch.Generator().manual_seed(mib), (LAYERS, 2, KV_HEADS, n, HEAD_DIM)
        data = self.s.alloc(shape, torch.float32) if self.kind == "nixl" and n else None   # as the executor builds it
        if self.kind == "nixl" and n and data is None:
            _progress(f"nixl {mib} MiB: the sender's pool is full, KV in ordinary memory (the send copies)")
        data = torch.randn(shape, generator=g) if data is None else torch.randn(shape, generator=g, out=data)
        self.kv = KVCache(data, torch.arange(n), torch.arange(100, 100 + n))
        return self.kv.data.nbytes

    @staticmethod
    def cpu() -> float:
        """CPU seconds this process has used (all threads, user + system)."""
        return sum(os.times()[:2])

    def push(self, address: str, tid: str, credential: str) -> tuple[float, float]:
        from kvtransport.transfer.blocks import encode_block
        t0 = time.perf_counter()
        if self.kind == "grpc-raw":
            self.t.send(address, tid, self.kv.data.numpy())
            return 0.0, time.perf_counter() - t0
        if self.kind in ("grpc", "grpc-crc"):
            from kvruntime.messages.transfer import KVEndpoint
            res = self.s.send(KVEndpoint("grpc", address, "float32"), tid, MODEL, self.kv,
                              credential=credential, timeout=120)
            used, stages, fallbacks = res.transport, res.stages, res.fallbacks
            if used != "grpc" or fallbacks:
                raise RuntimeError(f"the Sender used {used!r} with fallbacks {fallbacks}")
            return stages["serialise"], time.perf_counter() - t0 - stages["serialise"]
        if self.kind in ("nixl", "nixl-copy"):
            from kvruntime.messages.transfer import KVEndpoint
            staged = self.t.counters["staged_bytes"]
            ep = KVEndpoint("nixl", "127.0.0.1:9", "float32", nixl_agent=address)    # its metadata is loaded
            res = self.s.send(ep, tid, MODEL, self.kv, credential=credential, timeout=120)
            used, stages, fallbacks = res.transport, res.stages, res.fallbacks
            total = time.perf_counter() - t0
            if used != "nixl" or fallbacks:
                raise RuntimeError(f"the Sender used {used!r} with fallbacks {fallbacks}")
            self.zero_copy = self.t.counters["staged_bytes"] == staged
            return stages["serialise"], total - stages["serialise"]
        block = encode_block(tid, MODEL, self.kv, into=self.t.lease if self.kind == "nixl-serial" else None,
                             credential=credential)
        t1 = time.perf_counter()
        self.t.send(address, block, timeout=120)
        return t1 - t0, time.perf_counter() - t1

    def checksum(self) -> str | None:
        """(Receiver) ``none`` if every block of a gRPC row arrived unchecked, ``crc32c`` if none
        did, ``mixed`` otherwise; None for other rows."""
        if self.kind not in ("grpc", "grpc-crc"):
            return None
        s = self.t.stats()
        return "none" if s.unchecked == self.received else "crc32c" if not s.unchecked else "mixed"

    def copied_nothing(self) -> bool | None:
        """(Sender) whether the last push staged no bytes (None for rows without a Sender)."""
        return getattr(self, "zero_copy", None)

    def pull(self, tid: str, expect_bytes: int) -> float:
        from kvtransport.transfer.blocks import decode_block
        t0 = time.perf_counter()
        if self.kind == "grpc-raw":
            if (got := self.t.receive(tid, 120)) != expect_bytes:
                raise RuntimeError(f"received {got} bytes, expected {expect_bytes}")
            return time.perf_counter() - t0
        kv = decode_block(self.t.receive(tid, timeout=120), model=MODEL)
        dt = time.perf_counter() - t0
        self.received += 1
        if kv.data.nbytes != expect_bytes:
            raise RuntimeError(f"received {kv.data.nbytes} bytes, expected {expect_bytes}")
        return dt

    def copy(self, reps: int) -> list[float]:
        dst = torch.empty_like(self.kv.data)
        dst.copy_(self.kv.data)                                   # fault the pages in: a warm copy
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(self.kv.data)
            out.append(time.perf_counter() - t0)
        return out

    def stop(self) -> None:
        if self.kind in ("grpc", "grpc-crc"):
            self.s.stop()
        if self.kind != "copy":
            self.t.stop()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(mibs: list[int], reps: int, transports: list[str], ucx_error_handling: str = "peer",
        grpc_config: dict | None = None) -> list[dict]:
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}})
    # every sender, receiver (and the copy actor when no transport runs) fits in the 2 CPUs given
    # to Ray: a share too large would leave an actor pending forever
    actor = ray.remote(num_cpus=2 / (2 * len(transports) + 1))(Endpoint)
    rows = []
    try:
        pairs = {}
        for kind in transports:
            tx, rx = (actor.remote(kind, ucx_error_handling, grpc_config) for _ in range(2))
            addr = ray.get(rx.address.remote())
            if kind not in GRPC_KINDS:
                name, md = addr
                addr = ray.get(tx.add_peer.remote(name, md))
            pairs[kind] = (tx, rx, addr)
        for mib in mibs:
            copier = next(iter(pairs.values()))[0] if pairs else actor.remote("copy")
            nbytes = ray.get(copier.make.remote(mib))
            copy_s = statistics.median(ray.get(copier.copy.remote(reps)))
            copy_gbps = nbytes / copy_s / 1e9
            _progress(f"copy {mib} MiB: {copy_gbps:.2f} GB/s")
            ray.get([tx.make.remote(mib) for tx, _, _ in pairs.values()])
            seen = {kind: ([], [], [], []) for kind in pairs}    # totals, sends, tx CPU, rx CPU
            for i in range(reps + 1):            # rep-major: a slow spell of the VM hits every row alike
                for kind, (tx, rx, addr) in pairs.items():
                    tid = f"{kind}-{mib}-{i}"
                    grant, cred = ray.get(tx.grant.remote(tid))       # the router's part, untimed
                    ray.get(rx.expect.remote(grant))
                    c_tx, c_rx = ray.get([tx.cpu.remote(), rx.cpu.remote()])
                    enc, snd = ray.get(tx.push.remote(addr, tid, cred))
                    rcv = ray.get(rx.pull.remote(tid, nbytes))
                    c_tx, c_rx = (b - a for a, b in zip((c_tx, c_rx), ray.get([tx.cpu.remote(), rx.cpu.remote()])))
                    if i == 0:
                        continue                                      # warm-up
                    totals, sends, tx_cpu, rx_cpu = seen[kind]
                    totals.append(enc + snd + rcv)
                    sends.append(snd)
                    tx_cpu.append(c_tx * 1e9 / nbytes)
                    rx_cpu.append(c_rx * 1e9 / nbytes)
                    _progress(f"{kind} {mib} MiB rep {i}: encode {enc * 1e3:.1f} ms, send {snd * 1e3:.1f} ms, "
                              f"receive+decode {rcv * 1e3:.1f} ms -> {nbytes / (enc + snd + rcv) / 1e9:.2f} GB/s; "
                              f"CPU ns/byte sender {tx_cpu[-1]:.2f}, receiver {rx_cpu[-1]:.2f}")
            for kind, (tx, rx, addr) in pairs.items():
                totals, sends, tx_cpu, rx_cpu = seen[kind]
                row = {"transport": kind, "mib": mib, "gbps": round(nbytes / statistics.median(totals) / 1e9, 3),
                       "send_gbps": round(nbytes / statistics.median(sends) / 1e9, 3),
                       "copy_gbps": round(copy_gbps, 3), "reps": reps,
                       "tx_cpu_ns_b": round(statistics.median(tx_cpu), 3),
                       "rx_cpu_ns_b": round(statistics.median(rx_cpu), 3)}
                if (zero := ray.get(tx.copied_nothing.remote())) is not None:
                    row["zero_copy"] = zero
                if (crc := ray.get(rx.checksum.remote())) is not None:
                    row["checksum"] = crc
                rows.append(row)
            raw = next((r["gbps"] for r in rows if r["transport"] == "grpc-raw" and r["mib"] == mib), None)
            for r in rows:
                if raw and r["mib"] == mib and r["transport"] in ("grpc", "grpc-crc"):
                    r["of_grpc_raw"] = round(r["gbps"] / raw, 3)        # share of gRPC's own ceiling
            rows.append({"transport": "copy", "mib": mib, "gbps": round(copy_gbps, 3),
                         "copy_gbps": round(copy_gbps, 3), "reps": reps})
            for tx, rx, _ in pairs.values():
                ray.get(tx.make.remote(0))                            # free the sender's KV
        for tx, rx, _ in pairs.values():
            ray.get([tx.stop.remote(), rx.stop.remote()])
    finally:
        ray.shutdown()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="45,180,360", help="block sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median)")
    ap.add_argument("--transports", default="nixl,nixl-copy,nixl-serial,grpc,grpc-crc,grpc-raw",
                    help="nixl, nixl-copy, nixl-serial, nixl-staged, grpc, grpc-crc and/or grpc-raw "
                         "(copy always runs)")
    ap.add_argument("--grpc-config", default="{}",
                    help="JSON object of GrpcTransportConfig fields for both gRPC ends (A/B runs)")
    ap.add_argument("--ucx-error-handling", default="peer", choices=("peer", "none"),
                    help="NixlTransportConfig.ucx_error_handling for the NIXL rows (none: notifications "
                         "over shared memory, no peer-failure detection)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    mibs = [int(x) for x in args.mib.split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in NIXL_KINDS + GRPC_KINDS:
            raise SystemExit(f"unknown transport {t!r}; choose {', '.join(NIXL_KINDS + GRPC_KINDS)}")
    try:
        grpc_config = json.loads(args.grpc_config)
        from kvtransport.transfer.grpc_transport import GrpcTransportConfig
        GrpcTransportConfig(**grpc_config)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"--grpc-config: {exc}") from None
    rows = run(mibs, args.reps, transports, args.ucx_error_handling, grpc_config)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"# KV transfer between two Ray actors: fp32 SmolLM2-shaped KV, {os.cpu_count()} cores, "
          f"median of {args.reps}")
    print("| transport | MiB | GB/s (encode+send+receive+decode) | send GB/s | copy GB/s | of copy | of grpc-raw |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        send = f"{r['send_gbps']:.2f}" if "send_gbps" in r else "-"
        raw = f"{r['of_grpc_raw']:.0%}" if "of_grpc_raw" in r else "-"
        print(f"| {r['transport']} | {r['mib']} | {r['gbps']:.2f} | {send} | {r['copy_gbps']:.2f} | "
              f"{r['gbps'] / r['copy_gbps']:.0%} | {raw} |")


if __name__ == "__main__":
    main()
