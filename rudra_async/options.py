"""Configuration fields declared once: default, help, type and range live on the dataclass field.

A configuration class is a dataclass whose fields are made with :func:`setting`. From it
derive, without restating anything:

- :func:`click_options`: the command-line flags of a command (and, through click's
  ``auto_envvar_prefix``, their ``RUDRA_ASYNC_*`` environment variables);
- :func:`from_flat`: a configuration from a flat mapping of field names (click's keyword
  arguments, a study point, a config file), every value type-checked, unknown keys refused
  with the nearest valid name;
- :func:`check_ranges`: finiteness and range of every numeric field.

Nested configuration classes (fields made with :func:`section`) are flattened: their
fields take part under their own names, which must therefore be unique in the tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .errors import ConfigError

_MISSING = dataclasses.MISSING


T = TypeVar("T")


def env_value(name: str, default: T, convert: Callable[[str], T], expected: str) -> T:
    """The environment variable ``name`` through ``convert``; ``default`` when it is unset
    or empty; a ConfigError saying it must be ``expected`` when ``convert`` refuses it."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        return convert(text)
    except ValueError:
        raise ConfigError(f"{name} must be {expected}, got {text!r}") from None


def setting(
    default: Any = _MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    short: str | None = None,
    choices: Iterable[str] | None = None,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    below: float | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field carrying its documentation.

    ``low``/``high``: inclusive bounds; ``above``/``below``: exclusive ones. ``flag``: the
    long flag when it is not ``--field-name``; ``short``: e.g. ``-l``. ``parse`` turns a
    command-line string into the field's value (for types click does not know). ``cli``:
    False for fields that a command sets itself (not a flag)."""
    meta = {
        "help": help,
        "flag": flag,
        "short": short,
        "choices": tuple(choices) if choices else None,
        "low": low,
        "high": high,
        "above": above,
        "below": below,
        "parse": parse,
        "metavar": metavar,
        "cli": cli,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A field holding a nested configuration class (default: ``cls()``), flattened into
    its parent's settings."""
    return dataclasses.field(default_factory=cls, metadata={"section": True})


def _is_section(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("section"))


# -- types ---------------------------------------------------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, whether None is allowed)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return tp, False


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(name: str, tp: Any, value: Any, field: dataclasses.Field[Any] | None = None) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming the setting. Accepts what a config
    file or a JSON study point can hold: ints for floats, lists for tuples, strings for
    types with a parser (e.g. a shard ``"0/2"``)."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} must be set (got nothing)")
    parse = field.metadata.get("parse") if field is not None else None
    origin = typing.get_origin(inner)
    bad = ConfigError(f"{name} must be {_describe(inner)}, got {value!r}")
    if inner is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if inner is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (tuple, list):
        (item_tp, *_) = typing.get_args(inner) or (Any,)
        if isinstance(value, str) and parse is not None:
            return parse(value)
        if not isinstance(value, (list, tuple)):
            raise bad
        items = [coerce(f"{name}[{i}]", item_tp, v) if item_tp is not Any else v for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise bad
    if isinstance(inner, type) and isinstance(value, inner):
        return value
    if parse is not None and isinstance(value, str):
        return parse(value)
    if inner is Any:
        return value
    raise bad


# -- from a flat mapping -------------------------------------------------------------------
def flat_fields(cls: type, exclude: Iterable[str] = ()) -> dict[str, tuple[type, dataclasses.Field[Any], Any]]:
    """Every settable field of ``cls`` and its nested configuration classes, by name:
    ``name -> (owning class, field, type)``. Raises if two share a name."""
    out: dict[str, tuple[type, dataclasses.Field[Any], Any]] = {}
    skip = set(exclude)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(f):
            for name, entry in flat_fields(tp, skip).items():
                if name in out:
                    raise TypeError(f"configuration field {name!r} is declared twice under {cls.__name__}")
                out[name] = entry
        elif f.name not in skip and f.init:
            if f.name in out:
                raise TypeError(f"configuration field {f.name!r} is declared twice under {cls.__name__}")
            out[f.name] = (cls, f, tp)
    return out


def nearest(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or an empty string."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known(values: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Refuse keys that are not settings, naming the nearest valid one."""
    valid = list(valid)
    for key in values:
        if key not in valid:
            raise ConfigError(f"{where}: unknown setting {key!r}{nearest(key, valid)}")


def from_flat(
    cls: type, values: Mapping[str, Any], *, exclude: Iterable[str] = (), where: str = "configuration", **fixed: Any
) -> Any:
    """Build ``cls`` (and its nested configuration classes) from a flat mapping of field
    names. Every value is type-checked; unknown names are refused. ``fixed`` are values the
    caller sets itself (they bypass ``exclude``). None stands for "not given" (the default)
    unless the field may be None."""
    fields = flat_fields(cls, exclude)
    check_known(values, fields, where)
    given = {k: v for k, v in values.items() if v is not None or _unwrap_optional(fields[k][2])[1]}
    for name, (_, f, _tp) in fields.items():
        if f.default is _MISSING and f.default_factory is _MISSING and name not in given and name not in fixed:
            raise ConfigError(f"missing setting {name!r} ({_flag(name, f)})")
    return _build(cls, {**{k: coerce(k, fields[k][2], v, fields[k][1]) for k, v in given.items()}, **fixed})


def load_toml(path: str, what: str) -> dict[str, Any]:
    """The TOML file at ``path`` (a ``what``, for messages), or a ConfigError saying why not."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover (Python 3.10)
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            values: dict[str, Any] = tomllib.load(fh)
            return values
    except FileNotFoundError:
        raise ConfigError(f"no {what} at {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_file(cls: type, path: str, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The settings in the TOML file ``path`` for ``cls``: top-level keys named like the
    settings (the fields of ``cls`` and its sections, flat, as :func:`from_flat` takes
    them; only those that are flags). Unknown keys and values of the wrong type are refused
    with a ConfigError naming the file, the key and, for an unknown key, the nearest valid one."""
    values = load_toml(path, "config file")
    fields = {k: v for k, v in flat_fields(cls, exclude).items() if v[1].metadata.get("cli", True)}
    for key, instead in getattr(cls, "NOT_SETTINGS", {}).items():
        if key in values:
            raise ConfigError(f"config file {path}: {key!r} is not a setting here: {instead}")
    check_known(values, fields, f"config file {path}")
    for key, value in values.items():
        try:
            coerce(key, fields[key][2], value, fields[key][1])
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    return values


def _build(cls: type, values: dict[str, Any]) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(f):
            kwargs[f.name] = _build(tp, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def to_flat(obj: Any) -> dict[str, Any]:
    """The inverse of :func:`from_flat`: every field of ``obj`` and its nested configs by name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_section(f):
            out.update(to_flat(value))
        else:
            out[f.name] = value
    return out


# -- ranges --------------------------------------------------------------------------------
def check_ranges(obj: Any) -> None:
    """Every numeric field of ``obj`` (not nested ones) finite and within its declared range."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = "--" + f.name.replace("_", "-")
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
        low, high, above, below = (f.metadata.get(k) for k in ("low", "high", "above", "below"))
        if low is not None and value < low:
            raise ConfigError(f"{flag} must be >= {_shown(low)}, got {_shown(value)}")
        if above is not None and not value > above:
            raise ConfigError(f"{flag} must be > {_shown(above)}, got {_shown(value)}")
        if high is not None and value > high:
            raise ConfigError(f"{flag} must be <= {_shown(high)}, got {_shown(value)}")
        if below is not None and not value < below:
            raise ConfigError(f"{flag} must be < {_shown(below)}, got {_shown(value)}")


def _shown(number: float) -> str:
    """A bound or value as an error message shows it: an int exactly, a float briefly."""
    return str(number) if isinstance(number, int) else f"{number:g}"


# -- command-line flags --------------------------------------------------------------------
def _key_value(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


@functools.cache
def _setting_option() -> type:
    """The click option class of a setting's flag (made on first use: click loads only for
    the command line): a bad value that came from its ``RUDRA_ASYNC_*`` variable is reported
    naming the variable, which is what the user set (not the flag)."""
    import click
    from click.core import ParameterSource

    class SettingOption(click.Option):
        def process_value(self, ctx: click.Context, value: Any) -> Any:
            try:
                return super().process_value(ctx, value)
            except click.BadParameter as exc:
                if self.name is None or ctx.get_parameter_source(self.name) is not ParameterSource.ENVIRONMENT:
                    raise
                var = self.envvar if isinstance(self.envvar, str) else f"{ctx.auto_envvar_prefix}_{self.name.upper()}"
                raise click.BadParameter(exc.message, ctx=ctx, param_hint=f"the environment variable {var}") from None

    return SettingOption


def click_options(cls: type, exclude: Iterable[str] = ()) -> Callable[[Any], Any]:
    """A decorator adding one click option per settable field of ``cls`` (nested included),
    in declaration order. Each option's keyword argument is the field's name."""
    import click

    decorators = []
    for name, (_, f, tp) in flat_fields(cls, exclude).items():
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        inner, _ = _unwrap_optional(tp)
        flag = _flag(name, f)
        names = [flag, *([meta["short"]] if meta.get("short") else [])]
        default = f.default if f.default is not _MISSING else None
        kwargs: dict[str, Any] = {"help": meta.get("help") or None, "show_default": default not in (None, (), [], {})}
        parse = meta.get("parse")
        origin = typing.get_origin(inner)
        if inner is bool:
            if default:
                names = [f"{flag}/--no-{flag[2:]}"]
            kwargs.update(is_flag=True, default=bool(default))
        elif origin is list:
            kwargs.update(
                multiple=True,
                default=tuple(f.default_factory()) if f.default_factory is not _MISSING else None,
                show_default=True,
            )
        elif origin is dict:
            kwargs.update(
                multiple=True,
                metavar="KEY=VALUE",
                show_default=False,
                callback=lambda ctx, param, v: _click_parse(_key_value, v),
            )
        elif parse is not None:
            shown = f.default_factory() if f.default_factory is not _MISSING else default
            kwargs.update(
                default=None
                if shown in (None, ())
                else str(shown)
                if not isinstance(shown, tuple)
                else ",".join(f"{x:g}" for x in shown),
                callback=lambda ctx, param, v, parse=parse: None if v is None else _click_parse(parse, v),
            )
        else:
            click_type: Any = {int: int, float: float, str: str}.get(inner, str)
            if meta.get("choices"):
                click_type = click.Choice(meta["choices"])
            kwargs.update(type=click_type, default=default)  # a required one: from_flat says it is missing
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        decorators.append(click.option(*names, name, cls=_setting_option(), **kwargs))

    def apply(func: Any) -> Any:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _click_parse(parse: Callable[[Any], Any], value: Any) -> Any:
    import click

    try:
        return parse(value)
    except (ConfigError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None


def _flag(name: str, f: dataclasses.Field[Any]) -> str:
    """The command-line flag of setting ``name``."""
    return str(f.metadata.get("flag") or "--" + name.replace("_", "-"))


def command_line(obj: Any, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that set ``obj``'s scalar settings (numbers, strings, switches) that differ
    from their defaults, in declaration order (``click_options``' flags; lists and mappings
    are not given)."""
    args: list[str] = []
    defaults = to_flat(type(obj)())
    values = to_flat(obj)
    for name, (_, f, tp) in flat_fields(type(obj), exclude).items():
        inner, _ = _unwrap_optional(tp)
        value = values[name]
        if not f.metadata.get("cli", True) or value == defaults[name] or value is None:
            continue
        if inner is bool:
            args.append(_flag(name, f) if value else f"--no-{_flag(name, f)[2:]}")
        elif inner in (int, float, str) and not f.metadata.get("parse"):
            args += [_flag(name, f), f"{value:g}" if isinstance(value, float) else str(value)]
    return args
