"""Where a model's fidelity profile lives, keyed by what the weights are, not where they are.

A profile is the summary ``kvnotes eval fidelity`` / ``kvnotes calibrate`` writes (sections
``compose``, ``compose_sweep``, ``edit_informative`` ...); the planner reads it to choose what
``balanced`` may compose and how edits are applied (``cluster.control.planner``).

- ``kvnotes calibrate`` writes ``<profiles dir>/<spec.name>.json``, read first;
- the two shipped models also have ``kvruntime/fidelity/tables/<registry name>.json`` (in the
  package, from ``kvnotes eval fidelity``).

For a checkpoint directory ``spec.name`` is ``<dir name>-<16 hex digits of the content hash>``
(``kvruntime.hf_models``): a copy of the directory elsewhere finds the same profile, changed
weights find none. The profiles dir is the
  config's ``profiles_dir``, else ``$KVNOTES_CACHE/profiles`` (``~/.cache/kvnotes/profiles``).

No profile: the model is *uncalibrated*; ``balanced`` gets exact reuse only (``choose_compose``
says so) until ``kvnotes calibrate --model DIR`` measures one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvruntime.fidelity.report import TABLES_DIR, load_summary, save_summary


def default_profiles_dir() -> Path:
    from kvruntime.checkpoint import cache_root
    return cache_root() / "profiles"


def profiles_dir(configured: str | None = None) -> Path:
    """``configured`` (the config's ``profiles_dir``, ``~`` expanded) or the default."""
    return Path(configured).expanduser() if configured else default_profiles_dir()


@dataclass(frozen=True)
class Profile:
    """What the planner reads for one model, and where it came from (``/health`` shows it)."""
    model: str                     # spec.name: registry name, or <dir>-<content hash>
    path: Path                     # where it is (or would be written)
    summary: dict | None           # None: not calibrated

    @property
    def calibrated(self) -> bool:
        return self.summary is not None


def profile_path(spec, directory: str | Path | None = None) -> Path:
    """Where ``kvnotes calibrate`` writes ``spec``'s profile: ``<profiles dir>/<spec.name>.json``."""
    return profiles_dir(str(directory) if directory else None) / f"{spec.name}.json"


def find_profile(spec, directory: str | Path | None = None) -> Profile:
    """``spec``'s profile: a calibrated one in the profiles dir (by ``spec.name``, i.e. by content
    hash for a checkpoint), else for a shipped model its table in the package; else uncalibrated."""
    candidates = [profile_path(spec, directory)] + ([] if spec.checkpoint else [TABLES_DIR / f"{spec.name}.json"])
    for path in candidates:
        summary = load_summary(path.stem, path.parent)
        if summary is not None:
            return Profile(spec.name, path, summary)
    return Profile(spec.name, candidates[0], None)


def write_profile(spec, summary: dict, directory: str | Path | None = None) -> Path:
    """Save ``summary`` as ``spec``'s profile (see :func:`profile_path`)."""
    path = profile_path(spec, directory)
    return save_summary(path.stem, summary, path.parent)


def calibration_line(profile: Profile, model_arg: str) -> str:
    """One log line: the profile the planner reads, or that the model is uncalibrated and what
    that means (``model_arg``: the config's ``model``, for the command to run)."""
    if profile.calibrated:
        return f"model {profile.model} is calibrated: fidelity profile {profile.path}"
    return (f"model {profile.model} is not calibrated (no fidelity profile at {profile.path}): policy balanced "
            f"gets exact reuse only until `kvnotes calibrate --model {model_arg}` measures one")
