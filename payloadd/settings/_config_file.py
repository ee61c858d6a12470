"""The optional TOML config file of ``payloadd serve``: which file, and what it may hold.

The file is named by the ``config`` setting (``--config PATH``, ``PAYLOADD_CONFIG``);
without it, `DEFAULT_CONFIG` is read when it exists, and an empty value reads no file. Its
keys are the setting names, at the top level (``fields`` a table of tables); every key is
checked here, with the file and the key named in the error, before the settings are
built. A setting that a flag or a ``PAYLOADD_*`` variable also gives takes that value
whole: a table is never merged. Precedence: flag > environment > file > default.

pydantic-settings reads the file (`TomlConfigSettingsSource`); this module only picks the
file and checks its keys and values, against the settings class its source is given (it
imports nothing of ``_settings``, which imports it).
"""

from __future__ import annotations

import difflib
import functools
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

__all__ = ["DEFAULT_CONFIG", "NOT_IN_FILE", "ConfigFileError", "ConfigFileSource", "config_path"]

DEFAULT_CONFIG = Path("/etc/payloadd/payloadd.toml")
"""Read when it exists and no ``config`` setting names another file (or none)."""

NOT_IN_FILE = {
    "config": "a config file cannot name another one",
    "admin_token": "put the token in a file only the daemon's user can read (mode 0600) and "
    "set admin_token_file to that file, or set PAYLOADD_ADMIN_TOKEN",
}
"""Settings a config file may not hold, and why."""


class ConfigFileError(ValueError):
    """The config file cannot be used: missing (when named), unreadable, not TOML, or it
    holds an unknown key, a setting not allowed in it, or an invalid value. The message
    names the file and every bad key."""


def config_path(given: dict[str, Any]) -> Path | None:
    """The config file to read, from the ``config`` value of the flags and environment.

    ``given`` maps setting names to the values the flags and the environment give (the
    flag's value when both do). Returns ``None`` for no file: ``config`` is empty, or not
    given and `DEFAULT_CONFIG` does not exist.

    Raises
    ------
    ConfigFileError
        The named file does not exist or is not a regular file (for `DEFAULT_CONFIG`:
        exists and is not a regular file).
    """
    raw = given.get("config")
    if raw is None:
        if not os.path.lexists(DEFAULT_CONFIG):
            return None
        path, how = DEFAULT_CONFIG, "the default config file"
    elif not isinstance(raw, str | os.PathLike):
        return None  # not a path: the settings' own validation says so
    elif os.fspath(raw) == "":
        return None
    else:
        path, how = Path(raw), "config file"
    if not path.exists():
        named = " (the config setting)" if raw is not None else ""
        raise ConfigFileError(f"{how} {path}{named} does not exist")
    if not path.is_file():
        raise ConfigFileError(f"{how} {path} is not a regular file")
    return path


def _init_only(
    cls: type[BaseSettings],
    /,
    settings_cls: type[BaseSettings],
    init_settings: PydanticBaseSettingsSource,
    **others: PydanticBaseSettingsSource,
) -> tuple[PydanticBaseSettingsSource, ...]:
    """The sources of a settings class: its init arguments only (``others``, the environment,
    dotenv and secrets sources, are left out)."""
    return (init_settings,)


@functools.cache
def _file_values_class(settings_cls: type[BaseSettings]) -> type[BaseSettings]:
    """``settings_cls`` over its init arguments alone: no environment, no file (to check the
    file's values apart)."""
    namespace = {"settings_customise_sources": classmethod(_init_only)}
    return type(f"{settings_cls.__name__}FileValues", (settings_cls,), namespace)


def _bad_keys(
    settings_cls: type[BaseSettings], data: dict[str, Any], names: list[str]
) -> list[str]:
    lines = []
    for key, value in data.items():
        if key in NOT_IN_FILE:
            lines.append(f"{key}: not allowed in a config file: {NOT_IN_FILE[key]}")
        elif key not in names:
            close = difflib.get_close_matches(key.lower(), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"{key}: not a setting{hint}; the keys are the setting names")
        elif _needless_bool(settings_cls, key, value):
            lines.append(f"{key}: a boolean is not a valid value of this setting (got {value})")
    return lines


def _needless_bool(settings_cls: type[BaseSettings], key: str, value: object) -> bool:
    # pydantic's lax mode takes true for 1; in a typed file that is a mistake
    return isinstance(value, bool) and settings_cls.model_fields[key].annotation is not bool


def _bad_values(settings_cls: type[BaseSettings], data: dict[str, Any]) -> list[str]:
    try:
        _file_values_class(settings_cls)(**data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            where = ".".join(map(str, e["loc"])) or "settings"
            got = repr(e["input"])
            said = e["msg"].startswith(got)  # a size's message quotes the value itself
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"{where}: {e['msg']}" + ("" if said else f" (got {got})"))
        return lines
    return []


class ConfigFileSource(TomlConfigSettingsSource):
    """pydantic-settings' TOML source over the config file, its keys and values checked.

    Parameters
    ----------
    settings_cls : type
        The settings class (`Settings`).
    path : Path or None
        The config file (see `config_path`); ``None``: no file, no values.
    given : set of str
        Settings the flags or the environment give: the file's values of these are
        dropped, so that the higher source's value replaces the file's whole (a table
        included) instead of being merged into it.

    Raises
    ------
    ConfigFileError
        The file cannot be read, is not TOML (or not UTF-8), or holds an unknown key, ``config``,
        ``admin_token``, or an invalid value. The message names the file and each key.
    """

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None, given: set[str]):
        self.path = path
        self._given = given
        try:
            super().__init__(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:  # tomllib decodes the whole file first
            raise ConfigFileError(
                f"config file {path} is not valid TOML: not UTF-8 text (byte {exc.start}: "
                f"{exc.reason})"
            ) from None
        except OSError as exc:
            raise ConfigFileError(f"cannot read config file {path}: {exc.strerror}") from None
        names = [n for n in settings_cls.model_fields if n not in NOT_IN_FILE]
        data = self.toml_data
        known = {
            k: v for k, v in data.items() if k in names and not _needless_bool(settings_cls, k, v)
        }
        lines = _bad_keys(settings_cls, data, names) + _bad_values(settings_cls, known)
        if lines:
            raise ConfigFileError(
                f"invalid config file {path}:\n" + "\n".join(f"  {line}" for line in lines)
            )

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        values = {k: v for k, v in super().__call__().items() if k not in self._given}
        values.setdefault("config", self.path)  # the file read, when the default was
        return values
