"""Erratum wording: every correction sentence kvnotes appends lives here.

Measured on SmolLM2-135M (see docs/fidelity.md): restating the old value ("..., not <old>")
puts the old value back into context and a small model copies it, so the default does not
restate it. Styles are per model via the fidelity harness's table.
"""
from __future__ import annotations

ERRATUM_STYLES: dict[str, str] = {
    # name -> template; placeholders: {label} (human field name), {new}, {old}
    "correction": "\nCorrection: the {label} is now {new}.\n",
    "update": "\nUpdate: {label}: {new}. Use this value from now on.\n",
    "restate_old": "\nCorrection: the {label} is now {new}, not {old}.\n",
}
DEFAULT_ERRATUM_STYLE = "correction"


def erratum_text(label: str, new: str, old: str | None = None, style: str = DEFAULT_ERRATUM_STYLE) -> str:
    """The correction sentence for one changed field. ``ValueError`` for unknown styles or
    a style that needs ``old`` when it is missing."""
    if style not in ERRATUM_STYLES:
        raise ValueError(f"unknown erratum style {style!r}; known: {', '.join(ERRATUM_STYLES)}")
    template = ERRATUM_STYLES[style]
    if "{old}" in template and old is None:
        raise ValueError(f"erratum style {style!r} restates the old value; pass old=")
    if not label.strip() or not str(new).strip():
        raise ValueError("erratum needs a non-empty field label and new value")
    return template.format(label=label.strip(), new=str(new).strip(), old=old)
