"""Placeholders in Snakemake profiles: cluster values a user must set before any job runs.

A profile for a real cluster cannot know its partition (or GPU type), and a
wrong guess wastes a queue wait or lands GPU jobs on a CPU partition. So
``profiles/slurm/config.yaml`` holds placeholders such as::

    default-resources:
      slurm_partition: "SET_ME:your-gpu-partition"

and the Snakefile stops, while it is parsed (before the plan, before any
job), when a resource still holds one, with a message that names each
resource, the profile file and the two ways to set it. Snakemake has already
merged the profile and the command line by then: a value given with
``--default-resources`` or ``--set-resources`` replaces the profile's whole
list, placeholders included, so it passes.

Typical use in the Snakefile::

    message = unset_resources_message(workflow.resource_settings, sys.argv)
    if message:
        raise ProfileError(message)

Everything here except ``read_profile`` is pure: it reads values, not Snakemake.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardgen.errors import ShardgenError

PLACEHOLDER = "SET_ME"

# Example values for the message, per resource; anything else gets <value>.
EXAMPLES = {
    "slurm_partition": "gpu",
    "slurm_account": "myproj",
    "gpu_model": "h100",
    "constraint": "h100",
    "qos": "normal",
}

# How to find the right value on the cluster, per resource.
ADVICE = {
    "slurm_partition": "list the partitions, their GPUs and time limits with: sinfo -o '%P %G %l'",
    "slurm_account": "list your accounts with: sacctmgr -n show associations user=$USER format=account",
    "gpu_model": "Slurm's name of the GPU type: TYPE in the gpu:TYPE:N that sinfo -o '%P %G' shows",
    "constraint": "node features, as listed by: sinfo -o '%P %f'",
    "qos": "list the QoS you may use with: sacctmgr -n show associations user=$USER format=qos",
}


class ProfileError(ShardgenError):
    """A profile leaves a value unset. The message names each resource, the profile and the fix."""


@dataclass(frozen=True)
class Unset:
    """A resource whose value is still a placeholder.

    Attributes:
        name: the resource, e.g. ``slurm_partition``.
        hint: the placeholder's text after ``SET_ME:`` (what to put there).
        rule: the rule of a ``set-resources`` entry; None for ``default-resources``.
    """

    name: str
    hint: str
    rule: str | None = None

    @property
    def key(self) -> str:
        """How the command line names it: ``name`` or ``rule:name``."""
        return f"{self.rule}:{self.name}" if self.rule else self.name


def raw_value(value: Any) -> Any:
    """The value as written in the profile or on the command line.

    Snakemake keeps a profile's string resources unevaluated, as
    ``snakemake.resources.Resource`` objects whose ``raw`` attribute holds the
    text; plain values (from a parsed profile file, or tests) pass through.
    """
    raw = getattr(value, "raw", value)
    if isinstance(raw, str):
        raw = raw.strip()
        # A profile may quote a string twice ("'...'") to force a string.
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1].strip()
    return raw


def is_placeholder(value: Any) -> bool:
    """Whether a resource value is a ``SET_ME`` placeholder (``SET_ME`` or ``SET_ME:hint``)."""
    raw = raw_value(value)
    return isinstance(raw, str) and (raw == PLACEHOLDER or raw.startswith(PLACEHOLDER + ":"))


def placeholder_hint(value: Any) -> str:
    """The text after ``SET_ME:``, or '' for a bare ``SET_ME``."""
    raw = raw_value(value)
    return raw[len(PLACEHOLDER) + 1 :].strip() if isinstance(raw, str) and raw.startswith(PLACEHOLDER + ":") else ""


def unset_placeholders(resources: Mapping[str, Any] | None) -> list[str]:
    """The names of the resources that still hold a placeholder, in order.

    Args:
        resources: ``default-resources`` as a mapping (Snakemake's
            ``Resources`` object, or a plain dict); None means none were given.
    """
    return [name for name, value in (resources or {}).items() if is_placeholder(value)]


def find_unset(
    default_resources: Mapping[str, Any] | None, set_resources: Mapping[str, Mapping[str, Any]] | None = None
) -> list[Unset]:
    """Every placeholder in ``default-resources`` and in the per-rule ``set-resources``."""
    found = [Unset(name, placeholder_hint(default_resources[name])) for name in unset_placeholders(default_resources)]
    for rule, resources in (set_resources or {}).items():
        found += [Unset(name, placeholder_hint(resources[name]), rule) for name in unset_placeholders(resources)]
    return found


def profiles_in_use(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``--profile`` / ``--workflow-profile`` arguments of a snakemake command line, in order.

    Without ``--profile``, Snakemake uses ``$SNAKEMAKE_PROFILE``; so does this.
    """
    environ = os.environ if environ is None else environ
    found, has_profile = [], False
    for i, arg in enumerate(argv):
        for flag in ("--profile", "--workflow-profile"):
            if arg == flag and i + 1 < len(argv):
                found.append(argv[i + 1])
            elif arg.startswith(flag + "="):
                found.append(arg.split("=", 1)[1])
            else:
                continue
            has_profile = has_profile or flag == "--profile"
    if not has_profile and environ.get("SNAKEMAKE_PROFILE"):
        found.insert(0, environ["SNAKEMAKE_PROFILE"])
    return [p for p in found if p and p != "none"]


def profile_file(profile: str | Path) -> str:
    """The YAML file of a profile given as a directory (``profile.yaml``, else ``config.yaml``) or a file.

    A bare name that Snakemake looks up in its config directories is returned as given.
    """
    path = Path(profile)
    if path.is_dir():
        for name in ("profile.yaml", "config.yaml"):
            if (path / name).is_file():
                return str(path / name)
    return str(path)


def _files_with_placeholders(profiles: Sequence[str]) -> list[str]:
    """The profile files whose text holds a placeholder (all of them when none can be read)."""
    files = [profile_file(p) for p in profiles]
    holding = []
    for f in files:
        try:
            if PLACEHOLDER in Path(f).read_text():
                holding.append(f)
        except OSError:
            continue
    return holding or files


def unset_message(unset: Sequence[Unset], profiles: Sequence[str] = ()) -> str:
    """What to tell the user: each unset resource, the profile file, and the two ways to set it.

    Args:
        unset: from ``find_unset``; must not be empty.
        profiles: the profile files (or directories) in use, e.g. from ``profiles_in_use``.
    """
    files = _files_with_placeholders(profiles) if profiles else []
    where = " and ".join(files) if files else "your Snakemake profile (the file given with --profile)"
    first_file = files[0] if files else "the profile"
    lines = [
        f"the profile leaves {len(unset)} cluster value(s) unset: SET_ME placeholders in {where}. "
        "Nothing was run or submitted.",
    ]
    for u in unset:
        section = f"set-resources of rule {u.rule}" if u.rule else "default-resources"
        what = f": {u.hint}" if u.hint else ""
        advice = f" ({ADVICE[u.name]})" if u.name in ADVICE else ""
        lines.append(f"  - {u.key} ({section}){what}{advice}")
    lines.append("Set them in either of two ways:")
    edits = ", ".join(f"{u.name}: {EXAMPLES.get(u.name, '<value>')}" for u in unset)
    lines.append(f"  1. edit {first_file}: replace each SET_ME value (e.g. {edits}); every later run uses it;")
    defaults = [u for u in unset if not u.rule]
    per_rule = [u for u in unset if u.rule]
    lines.append("  2. or give the values on the command line, for this run:")
    if defaults:
        args = " ".join(f"{u.name}={EXAMPLES.get(u.name, '<value>')}" for u in defaults)
        if "slurm_account" not in {u.name for u in defaults}:
            args += " slurm_account=myproj"
        lines.append(f"       --default-resources {args}")
        lines.append(
            "     (--default-resources replaces the profile's whole default-resources list: "
            "name every default resource you need, e.g. slurm_account only if your cluster wants one)"
        )
    if per_rule:
        args = " ".join(f"{u.key}={EXAMPLES.get(u.name, '<value>')}" for u in per_rule)
        lines.append(f"       --set-resources {args}")
        lines.append("     (--set-resources likewise replaces the profile's whole set-resources)")
    return "\n".join(lines)


def unset_resources_message(resource_settings: Any, argv: Sequence[str] = (), environ=None) -> str | None:
    """The message for the Snakefile to raise, or None when no placeholder is left.

    Args:
        resource_settings: Snakemake's ``workflow.resource_settings`` (its
            ``default_resources``: the profile's ``default-resources`` or the
            command line's ``--default-resources``, None when neither gave
            any; its ``overwrite_resources``: ``set-resources`` per rule).
        argv: the snakemake command line (``sys.argv``), to name the profile file.
        environ: the environment (``$SNAKEMAKE_PROFILE``); default ``os.environ``.
    """
    unset = find_unset(
        getattr(resource_settings, "default_resources", None),
        getattr(resource_settings, "overwrite_resources", None),
    )
    if not unset:
        return None
    return unset_message(unset, profiles_in_use(argv, environ))


_RESOURCE = re.compile(r"^(?:(?P<rule>[A-Za-z_]\w*):)?(?P<name>[A-Za-z_]\w*)=(?P<value>.*)$", re.S)


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile file as Snakemake reads it (YTE templating included), with its resources as mappings.

    ``default-resources`` becomes ``{name: value}`` and ``set-resources``
    ``{rule: {name: value}}``, values as text; every other key is as
    Snakemake's profile parser returns it. The environment is read by a
    templated profile (``__use_yte__``) at this moment.
    """
    from snakemake.profiles import ProfileConfigFileParser

    with open(profile_file(path)) as stream:
        parsed = dict(ProfileConfigFileParser().parse(stream))
    defaults: dict[str, str] = {}
    for item in parsed.get("default-resources", []):
        m = _RESOURCE.match(item)
        if m is None or m["rule"]:
            raise ProfileError(f"{path}: default-resources: cannot read '{item}'")
        defaults[m["name"]] = m["value"]
    per_rule: dict[str, dict[str, str]] = {}
    for item in parsed.get("set-resources", []):
        m = _RESOURCE.match(item)
        if m is None or not m["rule"]:
            raise ProfileError(f"{path}: set-resources: cannot read '{item}'")
        per_rule.setdefault(m["rule"], {})[m["name"]] = m["value"]
    parsed["default-resources"] = defaults
    parsed["set-resources"] = per_rule
    return parsed
