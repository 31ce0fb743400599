"""The KV data plane's control values: where a decode worker receives blocks, the grant the
router issues for one transfer, and the per-stage timings that travel back with results.

A transfer is authorised by the router, never by the sender: the router draws a random
``credential`` per transfer, gives it to the prefill worker with the plan and tells the decode
worker to expect it (:class:`TransferGrant`, which holds only its SHA-256 plus what the block
must look like). The decode worker refuses any block it was not told to expect before it
reserves a byte for it.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from kvruntime.messages.keys import token_hash

#: stages of a request's KV path, in order (``kvnotes_stage_seconds{stage}``, ``explain``); ``held_copy``
#: (the decode engine keeping the prefix for later requests) runs after the first token, off its path
STAGES = ("tier_get", "rerotate", "forward", "serialise", "transfer", "receive", "load", "suffix_forward",
          "first_token", "held_copy")


def new_credential() -> str:
    """A fresh random per-transfer credential (128 bits, hex)."""
    return secrets.token_hex(16)


def credential_digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


@dataclass(frozen=True)
class KVEndpoint:
    """Where (and in which form) a decode worker receives KV blocks. ``transport`` is what it
    runs (``nixl`` or ``grpc``; a ``nixl`` endpoint also serves gRPC as the fallback path)."""
    transport: str
    grpc_address: str                  # host:port, the node's address as Ray reports it
    dtype: str                         # the decode engine's KV dtype: blocks travel in it
    node_id: str = ""                  # Ray node id of the decode worker
    nixl_agent: str = ""               # NIXL agent name (transport nixl)
    nixl_metadata: bytes = b""         # that agent's metadata, for the sender's add_peer


@dataclass(frozen=True)
class TransferGrant:
    """Router -> decode worker, before the prefill worker pushes: accept exactly this block."""
    transfer_id: str
    credential_sha256: str             # credential_digest(the credential the sender carries)
    model: str
    dtype: str                         # KV dtype of the payload
    tokens: int                        # token count of the block
    first_position: int                # positions are first_position .. first_position + tokens - 1
    tokens_sha256: str                 # token_hash of the block's token ids
    # the receive layout (set by the decode worker, never by the sender): None, a plain block; an
    # int, the block lands in a buffer with this many free slots after it (and ``first_position``
    # slots before it), where the decode session appends the suffix and the generated tokens
    room: int | None = None

    @staticmethod
    def issue(transfer_id: str, model: str, dtype: str, token_ids, first_position: int = 0) -> tuple["TransferGrant", str]:
        """A new grant and the credential to give the sender."""
        cred = new_credential()
        ids = tuple(token_ids)
        return TransferGrant(transfer_id, credential_digest(cred), model, dtype, len(ids), first_position,
                             token_hash(ids)), cred

    def mismatch(self, *, credential: str, model: str, dtype: str, positions, token_ids) -> tuple[str, str] | None:
        """None if a block with these header fields is the granted one, else (reason, message)."""
        if credential_digest(credential or "") != self.credential_sha256:
            return "bad_credential", f"transfer {self.transfer_id}: credential does not match the grant"
        if model != self.model:
            return "wrong_model", f"transfer {self.transfer_id}: block is of model {model!r}, granted {self.model!r}"
        if dtype != self.dtype:
            return "wrong_dtype", f"transfer {self.transfer_id}: block dtype {dtype}, granted {self.dtype}"
        want = tuple(range(self.first_position, self.first_position + self.tokens))
        if len(token_ids) != self.tokens or tuple(positions) != want:
            return "wrong_length", (f"transfer {self.transfer_id}: block holds {len(token_ids)} tokens, granted "
                                    f"{self.tokens} at positions {self.first_position}..")
        if token_hash(tuple(token_ids)) != self.tokens_sha256:
            return "wrong_tokens", f"transfer {self.transfer_id}: block token ids differ from the grant"
        return None


@dataclass(frozen=True)
class TransferExpectation:
    """Router -> decode worker, before any prefill (``DecodeWorker.expect``): the grant for the
    prefix block and the prefix itself, so the worker can say how much of it it already holds.
    The grant was issued from exactly these ids (``TransferGrant.issue``), so they are hashed
    once, by the router; the worker compares lengths only."""
    grant: TransferGrant
    prefix_ids: tuple[int, ...]        # the plan's prefix token ids, positions 0..len-1
    kv_salt: str                       # the plan's KV salt (RequestPlan.kv_salt): the held-prefix key
    computes_from: int | None = None   # held up to here (tokens), the worker computes the rest itself
    room: int = 0                      # tokens the decode leg adds after the prefix (suffix + max_tokens)

    def __post_init__(self):
        if self.grant.first_position != 0 or len(self.prefix_ids) != self.grant.tokens:
            raise ValueError(f"transfer {self.grant.transfer_id}: the expectation's {len(self.prefix_ids)} prefix "
                             f"ids do not match its grant ({self.grant.tokens} tokens from "
                             f"{self.grant.first_position})")


@dataclass(frozen=True)
class ExpectReply:
    """Decode worker -> router, the answer to a :class:`TransferExpectation`: who computes the
    rest of the prefix is decided here, once (``messages.plan.decode_computes_rest``)."""
    held: int                          # leading prefix tokens the worker holds (never built nor sent again)
    computes_rest: bool                # True: no block comes; the worker computes the rest itself
