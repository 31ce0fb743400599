"""gRPC's Python API alone, between two plain processes: which shape of it moves bytes fastest here.

    python -m bench.grpc_api [--variants sync/sync/tcp,aio/aio/tcp,sync/sync/uds,...] [--mib 180]
                             [--chunk-kib 1024] [--reps 7] [--json] [--transport-config JSON ...]

A variant is ``server/client/socket``: ``sync`` is ``grpc.server`` + a thread pool / a blocking
channel with a request iterator; ``aio`` is ``grpc.aio``'s server / channel (``call.write``);
``socket`` is ``tcp`` (127.0.0.1) or ``uds`` (a Unix domain socket). ``transport/transport/tcp``
is kvnotes' own path instead (``GrpcTransport.send_kv`` into ``GrpcTransport``'s server: header,
inbox, pool; no CRC-32C between these two processes of one host under the default ``checksum:
auto``, so ``--transport-config '{"checksum": "always"}'`` is what a push between hosts pays),
for comparison and for profilers (``perf record -- python -m
bench.grpc_api --variants transport/transport/tcp --reps 40``); each ``--transport-config
'{"field": value}'`` adds one more transport variant with those ``GrpcTransportConfig`` fields on
both ends (A/B of its settings in one interleaved run). Every raw variant sends
``--mib`` as ``--chunk-kib`` ``bytes`` messages (one copy each) that the server copies into one
warm array; both processes get the transport's malloc setting. Each server runs in its own
process; the client is this process; repetitions are interleaved across variants after one
warm-up each; GB/s = 1e9 bytes sent over the time from the first message to the server's reply,
median (the transport sends the whole tokens of SmolLM2-135M-shaped fp32 KV that fit, 4096 at 180
MiB). ``bench.transfer``'s ``grpc-raw`` row is ``sync/sync/tcp`` between Ray actors.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

SERVICE, METHOD = "kvnotes.bench.Api", "/kvnotes.bench.Api/Push"
SIDES, SOCKETS = ("sync", "aio"), ("tcp", "uds")


def _options(chunk: int) -> list:
    from kvtransport.transfer.grpc_transport import GrpcTransportConfig, tune_malloc
    cfg = GrpcTransportConfig(chunk_bytes=chunk, max_message_bytes=max(8 << 20, chunk + (1 << 20)))
    tune_malloc(cfg.malloc_keep_bytes)
    return cfg.channel_options()


def _serve(kind: str, target: str, chunk: int, total: int, ready, k: int = 0, stride: int = 1,
           config: dict | None = None) -> None:
    """Server process: report the address on ``ready``, then serve until killed. The transport
    server claims (and drops) transfer ``api-{k}``, ``api-{k + stride}``, ... as they arrive."""
    import grpc
    opts = _options(chunk)
    if kind == "transport":
        from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
        t = GrpcTransport(GrpcTransportConfig(**{"chunk_bytes": chunk, **(config or {})}), model="bench")
        ready.put(t.serve("127.0.0.1", 0))
        for i in itertools.count():
            t.receive(f"api-{i * stride + k}", timeout=3600)
        return
    dest = np.empty(total + chunk, np.uint8)
    dest[:] = 0                                        # warm

    def copy_in(m, got):
        dest[got:got + len(m)] = np.frombuffer(m, np.uint8)
        return got + len(m)

    def push(requests, context):
        got = 0
        for m in requests:
            got = copy_in(m, got)
        return got.to_bytes(8, "little")

    async def apush(requests, context):
        got = 0
        async for m in requests:
            got = copy_in(m, got)
        return got.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(apush if kind == "aio" else push)})
    if kind == "sync":
        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(target)
        server.start()
        ready.put(target if target.startswith("unix:") else f"127.0.0.1:{port}")
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server(options=opts)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(target)
        await server.start()
        ready.put(target if target.startswith("unix:") else f"127.0.0.1:{port}")
        await server.wait_for_termination()
    asyncio.run(main())


class Client:
    """One variant's client side, in this process."""

    def __init__(self, kind: str, address: str, chunk: int, config: dict | None = None):
        import grpc
        self.kind, self.chunk, self.address = kind, chunk, address
        opts = _options(chunk)
        if kind == "sync":
            self.call = grpc.insecure_channel(address, options=opts).stream_unary(METHOD)
        elif kind == "aio":
            self.loop = asyncio.new_event_loop()
            self.channel = self.loop.run_until_complete(self._aio_channel(address, opts))
        else:
            from kvtransport.transfer.grpc_transport import GrpcTransport, GrpcTransportConfig
            self.t = GrpcTransport(GrpcTransportConfig(**{"chunk_bytes": chunk, **(config or {})}), model="bench")

    @staticmethod
    async def _aio_channel(address, opts):
        import grpc
        return grpc.aio.insecure_channel(address, options=opts)

    def push(self, src: np.ndarray, i: int) -> int:
        """Send ``src`` (the transport: its whole tokens, see :func:`_block`); returns the bytes sent."""
        view, step = memoryview(src), self.chunk
        if self.kind == "sync":
            got = self.call(bytes(view[s:s + step]) for s in range(0, len(view), step))
        elif self.kind == "aio":
            got = self.loop.run_until_complete(self._apush(view, step))
        else:
            return self.t.send_kv(self.address, *_block(src, f"api-{i}"), timeout=120).bytes_sent
        if int.from_bytes(got, "little") != src.nbytes:
            raise RuntimeError(f"server received {int.from_bytes(got, 'little')} of {src.nbytes} bytes")
        return src.nbytes

    async def _apush(self, view, step):
        call = self.channel.stream_unary(METHOD)()
        for s in range(0, len(view), step):
            await call.write(bytes(view[s:s + step]))
        await call.done_writing()
        return await call


def _block(src: np.ndarray, tid: str):
    """The leading whole tokens of ``src`` as one KV block's header and payload, aliasing
    ``src``: fp32 KV of SmolLM2-135M's shape, as ``bench.transfer`` (30 layers, 2, 3 KV heads,
    tokens, head dim 64: 45 KiB a token, 4096 tokens in 180 MiB), so the header (positions and
    token ids) weighs what it weighs in the cluster."""
    import torch
    from bench.transfer import HEAD_DIM, KV_HEADS, LAYERS
    from kvruntime.kv import KVCache
    from kvtransport.transfer.blocks import block_header
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    n = src.nbytes // per_token
    data = torch.from_numpy(src[:n * per_token].view(np.float32)).view(LAYERS, 2, KV_HEADS, n, HEAD_DIM)
    return block_header(tid, "bench", KVCache(data, torch.arange(n), torch.arange(100, 100 + n)))


def _parse(variant: str) -> tuple[str, str, str, dict]:
    """``server/client/socket`` -> its parts and, for ``transport/transport/tcp+{json}``, the
    ``GrpcTransportConfig`` fields the JSON object overrides on both ends."""
    base, _, extra = variant.partition("+")
    parts = base.split("/")
    if parts == ["transport", "transport", "tcp"]:
        try:
            config = json.loads(extra) if extra else {}
            from kvtransport.transfer.grpc_transport import GrpcTransportConfig
            GrpcTransportConfig(**config)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"variant {variant!r}: bad transport config: {exc}") from None
        return "transport", "transport", "tcp", config
    if extra:
        raise ValueError(f"variant {variant!r}: only transport/transport/tcp takes a +{{config}}")
    if len(parts) != 3 or parts[0] not in SIDES or parts[1] not in SIDES or parts[2] not in SOCKETS:
        raise ValueError(f"variant {variant!r}: expected server/client/socket with server and client in "
                         f"{'|'.join(SIDES)}, socket in {'|'.join(SOCKETS)}, or transport/transport/tcp")
    return parts[0], parts[1], parts[2], {}


def run(variants: list[str], mib: int, chunk_kib: int, reps: int) -> list[dict]:
    parsed = [_parse(v) for v in variants]
    chunk, total = chunk_kib << 10, mib << 20
    ctx = mp.get_context("spawn")
    procs, clients, tmp = [], [], tempfile.mkdtemp(prefix="grpc_api_")
    try:
        for k, (server, client, sock, config) in enumerate(parsed):
            target = f"unix:{tmp}/s{k}.sock" if sock == "uds" else "127.0.0.1:0"
            ready = ctx.Queue()
            p = ctx.Process(target=_serve, args=(server, target, chunk, total, ready, k, len(variants), config),
                            daemon=True)
            p.start()
            procs.append(p)
            clients.append(Client(client, ready.get(timeout=120), chunk, config))
        src = np.frombuffer(bytearray(np.random.default_rng(0).bytes(total)), np.uint8)   # writable: torch aliases it
        rates = [[] for _ in variants]                  # bytes/s of each timed repetition
        for i in range(reps + 1):
            for k, (variant, c) in enumerate(zip(variants, clients)):
                t = time.perf_counter()
                sent = c.push(src, i * len(variants) + k)
                dt = time.perf_counter() - t
                if i:
                    rates[k].append(sent / dt)
                    print(f"{variant} rep {i}: {sent / dt / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
        return [{"variant": v, "mib": mib, "chunk_kib": chunk_kib, "reps": reps,
                 "gbps": round(statistics.median(rs) / 1e9, 3)} for v, rs in zip(variants, rates)]
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.grpc_api", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="sync/sync/tcp,aio/aio/tcp,sync/aio/tcp,aio/sync/tcp,sync/sync/uds,"
                                           "transport/transport/tcp")
    ap.add_argument("--transport-config", action="append", default=[], metavar="JSON",
                    help="add a transport/transport/tcp variant with these GrpcTransportConfig fields "
                         "(repeatable; for A/B runs of the transport's settings)")
    ap.add_argument("--mib", type=int, default=180)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v] + [f"transport/transport/tcp+{c}"
                                                             for c in args.transport_config]
    try:
        for v in variants:
            _parse(v)
        if args.mib < 1 or args.chunk_kib < 1 or args.reps < 1:
            raise ValueError("--mib, --chunk-kib and --reps must be >= 1")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    rows = run(variants, args.mib, args.chunk_kib, args.reps)
    for r in rows:
        print(json.dumps(r) if args.json else f"| {r['variant']} | {r['mib']} MiB | {r['gbps']:.2f} GB/s |")


if __name__ == "__main__":
    main()
