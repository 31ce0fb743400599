"""Request limits, all from config (``ClusterConfig.max_*``), and the two checks the control plane
applies itself: names (skills, memories, templates, sessions) and texts (registrations). The HTTP
edge applies the rest of the limits (``cluster.http.body``: body size and nesting,
``cluster.http.validate``: fields)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.control.errors import RequestError

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 << 20
    max_text_chars: int = 400_000
    max_segments: int = 256
    max_template_fields: int = 64
    max_name_chars: int = 128
    max_stop: int = 4
    max_stop_chars: int = 128
    max_tokens: int = 2048
    max_choices: int = 8

    @staticmethod
    def from_config(cfg) -> "RequestLimits":
        s = cfg.server
        return RequestLimits(s.max_body_bytes, s.max_text_chars, s.max_segments, s.max_template_fields,
                             s.max_name_chars, s.max_stop, s.max_stop_chars, s.max_tokens_limit, s.max_choices)


def check_name(name, limits: RequestLimits | None = None, *, what: str = "name") -> str:
    """Names of skills, memories, templates and sessions: letters, digits and ``. _ : -``,
    starting with a letter or digit, at most ``max_name_chars``."""
    n = (limits or RequestLimits()).max_name_chars
    if not isinstance(name, str) or len(name) > n or not _NAME_RE.fullmatch(name):
        raise RequestError(400, f"{what} must be 1-{n} characters of A-Z a-z 0-9 . _ : - starting with a letter "
                                f"or digit", param=what)
    return name


def check_text(v, limits: RequestLimits, what: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise RequestError(400, f"{what} must be a non-empty string", param=what)
    if len(v) > limits.max_text_chars:
        raise RequestError(400, f"{what} is {len(v)} characters; the limit is {limits.max_text_chars}", param=what)
    return v
