"""The sending half of :class:`~kvtransport.transfer.nixl_transport.NixlTransport`: offer a block from
registered memory, stream it (:meth:`NixlSender.send_kv`) and wait for the receiver's verdict.

Two ways a payload gets into registered memory:
- **it already lives there** (zero copy): the prefill built its KV in a lease of this
  transport's pool (``endpoints.Sender.alloc``: the prefill executor's one prefix buffer). ``send_kv``
  then copies nothing: it CRC-32Cs piece k and announces it, so the receiver READs piece k while
  piece k+1 is CRC'd (the READ is ~4x slower than the CRC: the sender stays ahead). Counted in
  ``counters["zero_copy_sends"]``.
- **staged**: a lease is taken and the payload copied into it piece by piece, each piece
  announced as it lands while the CRC thread checksums it. A tensor payload in another dtype
  (fp32 reference KV -> a bf16 engine) is cast *while* copied (one pass, no cast-to-new-tensor
  first); a non-contiguous one (a slice) is gathered the same way. Counted in
  ``counters["staged_bytes"]``.
Runs on the caller's thread; uses the transport's agent, lock, pool, config, CRC pool.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtransport.transfer.blocks import (DTYPES, KVBlock, KVBlockHeader, as_bytes_array, checksum_extend, payload_len,
                                payload_view)
from kvtransport.transfer.nixl_read import _CrcChain
from kvtransport.transfer.nixl_wire import CANCEL, Avail, Offer, Reply
from kvtransport.transfer.interface import TransferError, TransferReceipt


@dataclass
class _Outgoing:              # one open send, owned by the sending thread + the progress thread
    peer: str
    staging: np.ndarray | None              # [nbytes] uint8 lease, dropped on PULLED / reply / TTL
    since: float                            # time.monotonic() of the offer
    done: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None


class NixlSender:
    """Mixin for NixlTransport (attributes: ``_agent``, ``_lock``, ``_pool``, ``cfg``, ``_peers``,
    ``_introduced``, ``_out``, ``_quarantine``, ``_out_lock``, ``counters``, ``_crc_pool``, ``_wake``)."""

    def send(self, address: str, block: KVBlock, *, timeout: float = 30.0) -> TransferReceipt:
        """Offer ``block`` to the peer named ``address`` and block until it has pulled and verified
        it. Copies the payload once into a staging lease unless it already is one (see
        :meth:`lease`). Raises :class:`TransferError`
        (``unknown_peer``, ``too_large``, ``backpressure``, ``duplicate``, ``timeout``, or the
        receiver's reason)."""
        t0, deadline = time.perf_counter(), time.monotonic() + timeout
        tid, n = block.header.transfer_id, payload_len(block.payload)
        self._check_send(address, n, tid)
        staging = as_bytes_array(block.payload) if n else None
        if staging is None or not self._in_pool(staging):          # not encoded into our pool: stage it
            staging = self._lease_until(n, tid, deadline)
            staging[:] = as_bytes_array(block.payload)
            self.counters["staged_bytes"] += n
        out = self._post(address, block.header, staging, streamed=False)
        del staging
        return self._await(address, tid, out, n, t0, deadline, timeout)

    def _check_send(self, address: str, n: int, tid: str) -> None:
        if address not in self._peers:
            raise TransferError("unknown_peer", f"no metadata for NIXL peer {address!r}: call add_peer first")
        if n > self.cfg.pool_bytes:
            raise TransferError("too_large", f"block {tid} of {n} bytes exceeds the NIXL pool ({self.cfg.pool_bytes})")

    def _lease_until(self, n: int, tid: str, deadline: float):
        """A registered lease of ``n`` bytes, waiting for the pool until ``deadline`` (monotonic)."""
        buf = self._pool.lease(n)
        while buf is None:
            if time.monotonic() > deadline:
                raise TransferError("backpressure", f"NIXL send pool full for {tid} ({n} bytes)")
            time.sleep(self.cfg.busy_poll_s * 10)
            buf = self._pool.lease(n)
        return buf

    def send_kv(self, address: str, header: KVBlockHeader, payload, *, timeout: float = 30.0) -> TransferReceipt:
        """Pipelined send of ``payload``: the wire bytes (bytes-like, as
        :func:`~kvtransport.transfer.blocks.block_header` returns them) or a CPU tensor ``[layers, 2,
        kv_heads, tokens, head_dim]`` in any dtype (cast to ``header.dtype`` while copied). Zero
        copy when the payload already lives in this transport's pool in the wire dtype,
        contiguous; else staged (see the module docstring). Each ``stream_piece_bytes`` is
        announced as soon as it is in place; the CRC-32C travels last (``header.checksum`` is
        ignored). Blocks until the receiver has verified the block; raises like :meth:`send`,
        ``ValueError`` for a tensor whose shape is not the header's."""
        t0, deadline = time.perf_counter(), time.monotonic() + timeout
        tid, n = header.transfer_id, header.payload_bytes
        tensor = payload if isinstance(payload, torch.Tensor) else None
        if tensor is not None:
            want = (header.num_layers, 2, header.kv_heads, header.num_tokens, header.head_dim)
            if tuple(tensor.shape) != want or header.dtype not in DTYPES:
                raise ValueError(f"KV tensor {tuple(tensor.shape)} does not match its header {want} {header.dtype}")
            zero = (tensor.device.type == "cpu" and tensor.dtype == DTYPES[header.dtype] and tensor.is_contiguous()
                    and self._in_pool_range(tensor.data_ptr(), n))
            src = as_bytes_array(payload_view(tensor)) if zero else None
        else:
            src = as_bytes_array(payload)
            n, zero = src.nbytes, self._in_pool(src)
        self._check_send(address, n, tid)
        if n == 0:
            raise TransferError("too_large", f"a streamed block ({tid}) cannot be empty")
        buf = src if zero else self._lease_until(n, tid, deadline)
        out = self._post(address, header, buf, streamed=True)
        if zero:
            self.counters["zero_copy_sends"] += 1
            self._announce_in_place(address, tid, buf, out)
        else:
            self.counters["staged_bytes"] += n
            self._stage_and_announce(address, header, buf, tensor if tensor is not None else src, out)
        del buf, src
        return self._await(address, tid, out, n, t0, deadline, timeout)

    def _announce_in_place(self, address: str, tid: str, buf: np.ndarray, out) -> None:
        """Zero copy: CRC piece k (in cache from here on) and announce it; the receiver READs it
        while piece k+1 is CRC'd. The last announcement carries the CRC."""
        n, off, crc, step = buf.nbytes, 0, 0, self.cfg.stream_piece_bytes
        while off < n and not out.done.is_set():          # a refusal ends it early
            end = min(n, off + step)
            crc = checksum_extend(crc, buf[off:end])
            off = end
            with self._lock:
                self._safe_notify(address, Avail(tid, off, crc if off == n else 0).encode())

    def _stage_and_announce(self, address: str, header: KVBlockHeader, buf: np.ndarray, src, out) -> None:
        """Staged: copy ``src`` (bytes, or a tensor cast into the wire dtype layer group by layer
        group) into ``buf`` piece by piece, announce each piece at once, CRC it on the CRC thread."""
        tid, n, step = header.transfer_id, buf.nbytes, self.cfg.stream_piece_bytes
        if isinstance(src, torch.Tensor):
            layers = src.shape[0]
            dest = torch.from_numpy(buf).view(DTYPES[header.dtype]).view(src.shape)
            group = max(1, step // (n // layers))
            ends = [(min(layers, a + group), min(layers, a + group) * (n // layers)) for a in range(0, layers, group)]
        else:
            ends = [(None, min(n, a + step)) for a in range(0, n, step)]
        chain, off, layer = _CrcChain(self._crc_pool), 0, 0
        for stop_layer, end in ends:
            if out.done.is_set():                          # a refusal ends the copying early
                break
            if stop_layer is None:
                buf[off:end] = src[off:end]
            else:
                dest[layer:stop_layer].copy_(src[layer:stop_layer])   # cast + gather, one pass
                layer = stop_layer
            chain.add(buf[off:end])                        # CRC'd on its thread while the next piece is copied
            off = end
            with self._lock:
                self._safe_notify(address, Avail(tid, off, chain.result() if off == n else 0).encode())

    def _post(self, address: str, header: KVBlockHeader, staging: np.ndarray, *, streamed: bool):
        tid = header.transfer_id
        out = _Outgoing(address, staging, time.monotonic())
        with self._out_lock:
            if tid in self._out:
                raise TransferError("duplicate", f"transfer id {tid} is already being sent")
            self._out[tid] = out
        self._wake.set()                                           # the progress thread polls busily now
        md = b"" if address in self._introduced else self.metadata()
        offer = Offer(header, int(staging.ctypes.data), staging.nbytes, 0, md, streamed)
        try:
            with self._lock:
                self._agent.send_notif(address, offer.encode())
        except Exception as exc:  # nixl raises its own error types; the send fails, reported
            self._forget(tid)
            raise TransferError("unavailable", f"NIXL notify to {address} failed: {exc}") from None
        self._introduced.add(address)
        return out

    def _await(self, address: str, tid: str, out, n: int, t0: float, deadline: float,
               timeout: float) -> TransferReceipt:
        if not out.done.wait(max(0.0, deadline - time.monotonic())):
            self.counters["send_timeout"] += 1
            with self._lock:
                self._safe_notify(address, CANCEL + tid.encode())
            with self._out_lock:                                   # keep staging until PULLED or TTL
                self._out.pop(tid, None)
                if out.staging is not None:
                    self._quarantine[tid] = out
            raise TransferError("timeout", f"NIXL transfer {tid} to {address} not verified within {timeout:.1f} s")
        self._forget(tid)
        if not (reply := out.reply).ok:
            raise TransferError(reply.reason or "rejected", f"receiver rejected {tid}: {reply.error}")
        return TransferReceipt(tid, n, time.perf_counter() - t0)

    def lease(self, nbytes: int) -> np.ndarray | None:
        """Registered memory (None when full) for ``encode_block(into=...)`` or KV built in place:
        sent without staging."""
        return self._pool.lease(nbytes)

    def _in_pool(self, arr: np.ndarray) -> bool:
        return self._in_pool_range(int(arr.ctypes.data), arr.nbytes)

    def _in_pool_range(self, addr: int, nbytes: int) -> bool:
        return self._pool.address <= addr <= self._pool.address + self._pool.nbytes - nbytes

    def _forget(self, tid: str) -> None:
        with self._out_lock:
            out = self._out.pop(tid, None)
        if out is not None:
            out.staging = None                                     # the staging lease ends here
