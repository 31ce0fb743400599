"""``${VAR}`` in a config value, read from the environment (only ``state_url`` uses it)."""
from __future__ import annotations

import os
import re

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, key: str) -> str:
    """``value`` with each ``${NAME}`` replaced by the environment variable NAME, URL-quoted (a
    password may hold ``@ : /``); a ``$`` not in that form stays as it is. ValueError naming the
    variable (never a value) when it is unset. One pass: an expanded value is not expanded again."""
    from urllib.parse import quote

    def sub(m: re.Match) -> str:
        v = os.environ.get(m.group(1))
        if v is None:
            raise ValueError(f"{key}: environment variable {m.group(1)} is not set")
        return quote(v, safe="")
    return _ENV_REF.sub(sub, value)
