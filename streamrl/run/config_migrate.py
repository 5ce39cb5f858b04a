"""``streamrl config migrate OLD.yaml``: a config of an earlier layout rewritten in today's.

What it rewrites: a swappable part given as ``{name: X, option: value}`` becomes LightningCLI's
``{class_path: X, init_args: {option: value}}`` (``streamrl.run.swappable``), the flat LoRA keys
become the ``rl.lora`` section (``LoRASpec``'s arguments), ``rl.elastic: true`` with
``rl.max_generators`` becomes the elastic controller's ``class_path`` + ``init_args``, the
reward pool's and the instances' timeout keys become ``rl.reward_pool`` and ``rl.timeouts``
(``RewardPool``'s and ``Timeouts.for_model``'s arguments), ``rl.correction: icepop``, ``rl.is_cap``
and ``rl.correct_engine_gap`` become the ``rl.correction`` section (``OffPolicyCorrection``'s
arguments), ``rl.clip_eps`` and ``rl.kl_coef`` go to the algorithm's ``init_args``, and a
key that moved (``config_file.MOVED_KEYS``) goes to its new place. Everything else is kept as
written; the result is read back with the config's own checks of keys and types before it is
written.

Examples:
    >>> new, changes = migrate({"rl": {"dispatcher": {"name": "skew", "alpha": 0.3}}})
    >>> new
    {'rl': {'dispatcher': {'class_path': 'skew', 'init_args': {'alpha': 0.3}}}}
    >>> migrate({"rl": {"trainer_ranks": 2}})
    ({'rl': {}, 'trainer': {'devices': 2}}, ['rl.trainer_ranks -> trainer.devices'])
    >>> migrate({"rl": {"lora_r": 8, "lora_alpha": 16.0}})[0]
    {'rl': {'lora': {'r': 8, 'alpha': 16.0}}}
    >>> migrate({"rl": {"reward_workers": 0, "heartbeat_timeout_s": 5.0}})[0]
    {'rl': {'reward_pool': {'workers': 0}, 'timeouts': {'heartbeat_s': 5.0}}}
    >>> migrate({"rl": {"elastic": True, "max_generators": 3}})[0]
    {'rl': {'elastic': {'class_path': 'controller', 'init_args': {'max_instances': 3}}}}
    >>> migrate({"rl": {"correction": "icepop", "is_cap": 3.0}})[0]
    {'rl': {'correction': {'method': 'icepop', 'is_cap': 3.0}}}
    >>> migrate({"rl": {"kl_coef": 0.05}})[0]
    {'rl': {'algorithm': {'class_path': 'grpo', 'init_args': {'kl_coef': 0.05}}}}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from streamrl.errors import ConfigError
from streamrl.run.config import RLConfig, RunConfig
from streamrl.run.config_file import (
    FOLDED_KEYS,
    MOVED_KEYS,
    from_dict,
    read_config_text,
    read_yaml,
)
from streamrl.run.swappable import SWAPPABLE
from streamrl.runtime.references import from_name_layout

#: Folded keys whose ``null`` is a setting of its own, not the default: moved as they are.
NULL_IS_A_SETTING = {"stop_deadline_s"}  # null: no limit (the default: 60 s)

#: Keys that moved, as ``(section, key)`` -> ``(section, key)``; the value moves unchanged.
RENAMED = {
    ("rl", "trainer_ranks"): ("trainer", "devices"),
    ("rl", "share_trainer_gpus"): ("trainer", "share_gpus"),
}


def migrate(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` (a config's mapping) in today's layout, and what changed, one line each."""
    new, changes = copy.deepcopy(data), []
    rl = new.get("rl")
    if isinstance(rl, dict):
        for key in SWAPPABLE:
            value = rl.get(key)
            if isinstance(value, dict) and "name" in value and "class_path" not in value:
                rl[key] = from_name_layout(value)
                changes.append(
                    f"rl.{key}: {{name: {value['name']}, ...}} -> class_path + init_args"
                )
    if isinstance(rl, dict):
        _lora_section(rl, changes)
        _correction_section(rl, changes)
        _elastic_controller(rl, changes)
        _folded(rl, changes)
    for (section, key), (to_section, to_key) in RENAMED.items():
        old = new.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        target = new.setdefault(to_section, {})
        if to_key in target:
            raise ConfigError(
                f"{section}.{key} moved to {to_section}.{to_key}, which the file sets too: "
                "keep one of them."
            )
        target[to_key] = old.pop(key)
        changes.append(f"{section}.{key} -> {to_section}.{to_key}")
    return new, changes


def _lora_section(rl: dict[str, Any], changes: list[str]) -> None:
    """``rl.lora_r: 8, lora_alpha: 16`` -> ``rl.lora: {r: 8, alpha: 16}``; a rank of 0 (full
    fine-tuning) -> no ``rl.lora``."""
    lora = {key: name for key, (section, name, _) in FOLDED_KEYS.items() if section == "lora"}
    old = {key: rl.pop(key) for key in lora if key in rl}
    if not old:
        return
    keys = ", ".join(f"rl.{key}" for key in old)
    if "lora" in rl:
        raise ConfigError(f"{keys} moved to rl.lora, which the file sets too: keep one of them.")
    if old.get("lora_r", 0) > 0:
        rl["lora"] = {lora[key]: value for key, value in old.items()}
        changes.append(f"{keys} -> rl.lora")
    else:
        changes.append(f"{keys} -> no rl.lora (rank 0: the full model trains)")


def _correction_section(rl: dict[str, Any], changes: list[str]) -> None:
    """``rl.correction: icepop`` (or ``{name: icepop, low: 0.4}``) -> ``rl.correction: {method:
    icepop, ...}`` (``OffPolicyCorrection``'s arguments); ``null`` (the default) -> no key."""
    old = rl.get("correction", {})
    if isinstance(old, dict) and "name" not in old:  # absent, or already the section
        return
    del rl["correction"]
    if isinstance(old, dict):
        rl["correction"] = {"method": old["name"], **{k: v for k, v in old.items() if k != "name"}}
        changes.append("rl.correction: {name: ...} -> {method: ...}")
    elif old is not None:
        rl["correction"] = {"method": old}
        changes.append(f"rl.correction: {old} -> {{method: {old}}}")
    else:
        changes.append("rl.correction: null -> no rl.correction (its defaults)")


def _elastic_controller(rl: dict[str, Any], changes: list[str]) -> None:
    """``rl.elastic: true, max_generators: 4`` -> ``rl.elastic: {class_path: controller,
    init_args: {max_instances: 4}}`` (4: the earlier default); ``false`` -> no ``rl.elastic``
    (and ``max_generators``, unused, dropped)."""
    on, most = rl.get("elastic"), rl.pop("max_generators", None)
    if isinstance(on, bool):
        del rl["elastic"]
        new = "null"
        if on:
            init = {"max_instances": 4 if most is None else most}
            rl["elastic"], new = {"class_path": "controller", "init_args": init}, "class_path"
        changes.append(f"rl.elastic: {str(on).lower()} -> {new}")
    elif isinstance(on, dict) and most is not None:  # already a class_path: the bound goes in
        on.setdefault("init_args", {}).setdefault("max_instances", most)
    if most is not None:
        changes.append("rl.max_generators -> rl.elastic's init_args: {max_instances: N}")


def _folded(rl: dict[str, Any], changes: list[str]) -> None:
    """``rl.reward_workers: 0`` -> ``rl.reward_pool: {workers: 0}``, and so on
    (``config_file.FOLDED_KEYS``); a ``null`` (a timeout's default) is left out, unless it
    means something else (``NULL_IS_A_SETTING``), and a section only it would have made is not
    written empty."""
    before = set(rl)
    for key, (section, name, _) in FOLDED_KEYS.items():
        if key not in rl or section == "lora":  # LoRA: rank 0 is no section (_lora_section)
            continue
        value = rl.pop(key)
        if section in SWAPPABLE:  # into its init_args (the default part when it is unset)
            part = rl.get(section, RLConfig.__dataclass_fields__[section].default)
            if not isinstance(part, dict):
                part = {"class_path": part}
            rl[section] = part
            into = part.setdefault("init_args", {})
        else:
            into = rl.setdefault(section, {})
        if name in into:
            raise ConfigError(
                f"rl.{key} moved to rl.{section}'s {name}, which the file sets too: keep one."
            )
        if value is not None or key in NULL_IS_A_SETTING:
            into[name] = value
        changes.append(f"rl.{key} -> {MOVED_KEYS[RLConfig][key]}")
    for section in set(rl) - before:
        if rl[section] == {}:
            del rl[section]


def migrate_file(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write ``path`` in today's layout to ``out`` (default: ``<name>.migrated.yaml`` beside
    it) and return ``{"written", "changes"}``.

    Raises:
        ConfigError: an unreadable file, or one that is wrong in today's layout for another
            reason than its layout (a misspelled key, a wrong type): fix it, then run again.
    """
    path = Path(path)
    data = read_yaml(read_config_text(path))
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of keys to values.")
    new, changes = migrate(data)
    from_dict(RunConfig, new, where=f"{path} (migrated)")  # keys and types, as fit reads them
    target = Path(out) if out else path.with_suffix(".migrated.yaml")
    if target.resolve() == path.resolve():
        raise ConfigError(f"--out {target}: the file to migrate; write to another one.")
    note = f"# {path.name} in streamrl's config layout of today (streamrl config migrate);"
    note += " its comments are not carried over.\n"
    target.write_text(note + yaml.safe_dump(new, sort_keys=False))
    return {"written": str(target), "changes": changes}
