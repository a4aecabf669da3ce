"""Parse ``--bind_core`` / ``--bind_numa`` values (msrun's formats, stricter checks).

Accepted, as in msrun: ``True``/``False`` (any case), a legacy per-device JSON dict
``{"device0": ["0-3"], "scheduler": ["4"]}`` and, for ``--bind_numa`` only, the unified JSON
(``bind_config`` / ``bind_cpu`` / ``bind_memory``) given inline or as a file path. Unlike msrun,
which accepts malformed values and fails (or binds nothing) once the job runs, every form is
validated here, before anything starts.
"""

from __future__ import annotations

import os

from pytest_msrun.cpulist import RangeSyntaxError, parse_id_list
from pytest_msrun.record import field, record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

UNIFIED_KEYS = ("bind_config", "bind_cpu", "bind_memory")
CPU_MODES = ("cpu", "numa", "none")
MEMORY_MODES = ("numa", "none")
MODULES = ("main", "runtime", "pynative", "minddata")


def _device_number(key: str, underscore: bool) -> str | None:
    """The digits of ``deviceN`` (``device_N`` too when ``underscore``), else None. String tests,
    not a regular expression: re (and json) stay off msrun's start path unless a JSON value is given."""
    if not key.startswith("device"):
        return None
    digits = key[7:] if underscore and key.startswith("device_") else key[6:]
    return digits if digits.isdecimal() and digits.isascii() else None


class BindingError(ValueError):
    """Binding cannot be done as asked; ``flag`` names the option to fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


class BindFlagError(ValueError):
    """A binding flag value is malformed; the text names the offending key."""


@record
class BindSpec:
    """A parsed binding flag.

    ``kind`` is ``off``, ``auto``, ``dict`` (legacy per-device lists) or ``unified``.
    ``entries`` maps ``deviceN``/``scheduler`` to id-range strings (legacy dict) and
    ``unified`` holds the normalised unified JSON object.
    """

    kind: str = "off"
    entries: dict[str, list[str]] = field(default_factory=dict)
    unified: dict[str, Any] = field(default_factory=dict)
    file: str = ""
    file_hash: str = ""

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    def to_json(self) -> Any:
        if self.kind in ("off", "auto"):
            return self.kind == "auto"
        if self.kind == "dict":
            return dict(self.entries)
        out: dict[str, Any] = dict(self.unified)
        if self.file:
            out["__file__"] = self.file
        return out


def _legacy_dict(obj: dict[str, Any], unit: str) -> BindSpec:
    entries: dict[str, list[str]] = {}
    for key, val in obj.items():
        if str(key) != "scheduler" and _device_number(str(key), underscore=False) is None:
            raise BindFlagError(f"key {key!r} must be 'scheduler' or 'deviceN' (N = physical device id)")
        if not isinstance(val, list):
            raise BindFlagError(f"value of {key!r} must be a list of range strings, got {val!r}")
        items: list[str] = []
        for item in val:
            if not isinstance(item, str):
                raise BindFlagError(f'{unit} {item!r} in {key!r} must be a string such as "0-3" or "0,2,4"')
            text = "".join(item.split())
            try:
                parse_id_list(text, unit)
            except RangeSyntaxError as exc:
                raise BindFlagError(f"{key!r}: {exc}") from None
            if text:
                items.append(text)
        entries[str(key)] = items
    return BindSpec(kind="dict", entries=entries)


def _range_value(val: Any, where: str, unit: str) -> str:
    """A range string (or, for NUMA ids, an int) -> normalised range text."""
    if isinstance(val, bool) or not isinstance(val, (str, int)):
        raise BindFlagError(f'{where} must be a range string such as "0-3", got {val!r}')
    if isinstance(val, int):
        if unit == "CPU":
            raise BindFlagError(f'{where} must be a CPU range string such as "{val}", not the int {val}')
        val = str(val)
    text = "".join(val.split())
    try:
        if not parse_id_list(text, unit):
            raise BindFlagError(f"{where} is empty")
    except RangeSyntaxError as exc:
        raise BindFlagError(f"{where}: {exc}") from None
    return text


def normalise_unified(obj: dict[str, Any]) -> dict[str, Any]:
    """Validate a unified bind object; keys ``device_N`` become ``deviceN``."""
    cfg = obj.get("bind_config", {})
    if not isinstance(cfg, dict):
        raise BindFlagError("'bind_config' must be a JSON object")
    unknown = set(obj) - set(UNIFIED_KEYS)
    if unknown:
        raise BindFlagError(f"unknown top-level key(s) {sorted(unknown)}; allowed: {list(UNIFIED_KEYS)}")
    cpu_mode = str(cfg.get("bind_cpu_mode", "none")).lower()
    mem_mode = str(cfg.get("bind_memory_mode", "none")).lower()
    if cpu_mode not in CPU_MODES:
        raise BindFlagError(f"'bind_config.bind_cpu_mode' is {cpu_mode!r}; it supports 'cpu', 'numa' or 'none'")
    if mem_mode not in MEMORY_MODES:
        raise BindFlagError(f"'bind_config.bind_memory_mode' is {mem_mode!r}; it supports 'numa' or 'none'")
    fix = cfg.get("actor_thread_fix_bind", False)
    if not isinstance(fix, bool):
        raise BindFlagError(f"'bind_config.actor_thread_fix_bind' must be true or false, got {fix!r}")
    extra = set(cfg) - {"bind_cpu_mode", "bind_memory_mode", "actor_thread_fix_bind"}
    if extra:
        raise BindFlagError(f"unknown key(s) {sorted(extra)} in 'bind_config'")

    def keyed(section: str) -> dict[str, Any]:
        raw = {} if obj.get(section) is None else obj[section]
        if not isinstance(raw, dict):
            raise BindFlagError(f"'{section}' must be a JSON object keyed by 'deviceN' or 'scheduler'")
        out: dict[str, Any] = {}
        for key, val in raw.items():
            number = _device_number(str(key), underscore=True)
            if key != "scheduler" and number is None:
                raise BindFlagError(
                    f"invalid key {key!r} in '{section}': only 'deviceX', 'device_X' and 'scheduler' are supported"
                )
            norm = "scheduler" if key == "scheduler" else f"device{int(str(number))}"
            if norm in out:
                raise BindFlagError(f"key {key!r} in '{section}' duplicates {norm!r}")
            out[norm] = val
        return out

    bind_cpu = keyed("bind_cpu")
    bind_memory = keyed("bind_memory")
    cpu_out: dict[str, Any] = {}
    for key, val in bind_cpu.items():
        where = f"'bind_cpu.{key}'"
        if cpu_mode == "cpu":
            if not isinstance(val, dict):
                raise BindFlagError(f"{where} must be an object mapping modules {list(MODULES)} to CPU ranges")
            mods: dict[str, str] = {}
            for mod, rng in val.items():
                if mod not in MODULES:
                    raise BindFlagError(f"{where} has unknown module {mod!r}; modules are {list(MODULES)}")
                mods[mod] = _range_value(rng, f"'bind_cpu.{key}.{mod}'", "CPU")
            cpu_out[key] = mods
        elif cpu_mode == "numa":
            cpu_out[key] = _range_value(val, where, "NUMA")
        else:
            cpu_out[key] = val
    mem_out = {key: _range_value(val, f"'bind_memory.{key}'", "NUMA") for key, val in bind_memory.items()}
    return {
        "bind_config": {"bind_cpu_mode": cpu_mode, "bind_memory_mode": mem_mode, "actor_thread_fix_bind": fix},
        "bind_cpu": cpu_out,
        "bind_memory": mem_out,
    }


def _load_bind_file(value: str) -> BindSpec:
    path = os.path.abspath(value)
    if not os.path.exists(path):
        raise BindFlagError(f"bind_numa json file {value!r} does not exist")
    if not os.path.isfile(path):
        raise BindFlagError(f"bind_numa json path {value!r} is not a file")
    import hashlib
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        obj = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BindFlagError(f"failed to load bind_numa json file {value!r}: {exc}") from None
    if not isinstance(obj, dict):
        raise BindFlagError(f"bind_numa json file {value!r} should be a JSON object")
    if not any(k in obj for k in UNIFIED_KEYS):
        raise BindFlagError(f"bind_numa json file {value!r} has no 'bind_config'; see the unified JSON format")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()  # as msrun hashes it: the text, re-encoded UTF-8
    return BindSpec(kind="unified", unified=normalise_unified(obj), file=path, file_hash=digest)


def parse_bind_value(value: str, flag: str) -> BindSpec:
    """Parse one ``--bind_core``/``--bind_numa`` value; raise :class:`BindFlagError` on bad input."""
    text = value.strip()
    if text.lower() in ("true", "false"):
        return BindSpec(kind="auto" if text.lower() == "true" else "off")
    if flag == "bind_numa" and not text.startswith("{"):
        return _load_bind_file(text)
    import json

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BindFlagError(f"value is neither True/False nor a JSON object ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise BindFlagError(f"value must be True, False or a JSON object, got {type(obj).__name__}")
    if any(k in obj for k in UNIFIED_KEYS):
        if flag != "bind_numa":
            raise BindFlagError("the unified JSON format (bind_config/bind_cpu/bind_memory) belongs to --bind_numa")
        return BindSpec(kind="unified", unified=normalise_unified(obj))
    return _legacy_dict(obj, "CPU" if flag == "bind_core" else "NUMA")
