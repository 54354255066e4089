"""Typed stage configs: one dataclass per stage, loaded from YAML/JSON, overridden from the CLI.

Every job declares a ``@dataclass`` whose fields carry their help text in
``field(metadata={"help": ...})``. :func:`parse_args` turns that dataclass into an
argparse parser (one ``--flag`` per field, list fields repeatable), reads an
optional ``--config FILE`` first and lets flags override it. Values are coerced
and checked against the field's type annotation, and a bad value raises
:class:`ConfigError` naming the field and what it accepts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


class InputError(ValueError):
    """A problem with what the user gave a job (a config value, a path, a file's content).

    Entrypoints print its message as one line and exit 2; the message names the input and the fix.
    Each layer's usage errors (``PrepareError``, ``ShardSetError``, ...) derive from it.
    """


class ConfigError(InputError):
    """A config value is missing, unknown or of the wrong type; the message names the field."""


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple, Sequence):
        (inner, *_) = get_args(tp) or (str,)
        plural = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}.get(inner)
        return f"a list of {plural}" if plural else f"a list, each {_describe(inner)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None)) + " (or null)"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (from YAML, JSON or a CLI string) to ``tp`` or raise ConfigError."""
    origin = get_origin(tp)
    bad = ConfigError(f"{name}: expected {_describe(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
            if type(None) in args:
                return None
            raise bad
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, arg, value)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise bad
    if origin in (list, tuple):
        (inner, *_) = get_args(tp) or (str,)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        if inner is not str:
            # "--lrs 0.01,0.03" and "--lrs 0.01 --lrs 0.03" mean the same; strings (paths) keep commas.
            value = [p for v in value for p in (v.split(",") if isinstance(v, str) else [v]) if p != ""]
        return [_coerce(name, inner, v) for v in value]
    if origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise bad from None
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise bad from None
        if not math.isfinite(number):
            # inf or nan passes every "> 0" check and overflows later, in the middle of a run.
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    return value


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def from_dict(cls: type[T], data: dict[str, Any], *, source: str = "config") -> T:
    """Build ``cls`` from a mapping, coercing every value; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of field: value, got {type(data).__name__}")
    fields = _fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}; accepted fields: {', '.join(fields)}"
        )
    kwargs = {k: _coerce(k, fields[k][1], v) for k, v in data.items()}
    missing = [
        name
        for name, (f, _) in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{source}: required field(s) missing: {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc


#: A config is a page of settings; anything larger is a mistake or an attack on the parser.
MAX_CONFIG_BYTES = 1_000_000


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without aliases: a few hundred bytes of nested ``*a`` references
    expand to gigabytes (the "billion laughs"), and no vitscale config needs them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found the alias *{event.anchor}; aliases are not accepted, write the value out",
                event.start_mark)
        return super().compose_node(parent, index)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: {size} bytes is too large for a config file (at most {MAX_CONFIG_BYTES}); "
                          "pass the settings file itself")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from exc
    return data or {}


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# -- recipe or where it ran --------------------------------------------------------------------
# Each config field says once, in ``field(metadata={"recipe": ...})``, what it is to the run:
#   True (the default)  it decides what the run computes: hashed, compared by the report, fixed on resume;
#   "length"            how long the schedule runs: hashed and compared, but a resume may extend it;
#   False               where and how the run executes (paths, Ray, parallelism, logging): left out of
#                       the hash and the report's comparison, and free to change on resume.
# config_hash, the resume checks, the sweep state and the report all read this mark.
# A recipe field added after runs were recorded also names, in ``metadata={"off": value}``, the value
# that leaves the run as it was: at that value it stays out of the hash, and a record written before
# the field existed reads as that value, so today's runs keep their hash and old checkpoints resume.
RECIPE_MARKS = (True, "length", False)


def recipe_mark(cfg: Any, name: str) -> bool | str:
    """The ``recipe`` mark of field ``name`` of a config dataclass (class or instance)."""
    f = {f.name: f for f in dataclasses.fields(cfg)}[name]
    mark = f.metadata.get("recipe", True)
    if mark not in RECIPE_MARKS:
        owner = cfg if isinstance(cfg, type) else type(cfg)
        raise TypeError(f"{owner.__name__}.{name}: recipe mark {mark!r} is not one of {RECIPE_MARKS}")
    return mark


def not_recipe(cfg: Any) -> frozenset[str]:
    """Fields that say where and how a run executes, not what it computes."""
    return frozenset(f.name for f in dataclasses.fields(cfg) if recipe_mark(cfg, f.name) is False)


def free_on_resume(cfg: Any) -> frozenset[str]:
    """Fields a resumed run may change: where it runs, and the length of its schedule."""
    return frozenset(f.name for f in dataclasses.fields(cfg) if recipe_mark(cfg, f.name) is not True)


def changed_fields(saved: Mapping[str, Any], current: Mapping[str, Any], free: Iterable[str] = (),
                   absent: Mapping[str, Any] | None = None) -> list[str]:
    """The fields, sorted, that differ between a recorded config and this one, ``free`` aside: what
    a resume that would mix two runs changed. An absent field reads as its value in ``absent``
    (:func:`off_values`), else as None."""
    free, absent = frozenset(free), absent or {}
    return sorted(k for k in set(saved) | set(current)
                  if k not in free and saved.get(k, absent.get(k)) != current.get(k, absent.get(k)))


def off_values(cfg: Any) -> dict[str, Any]:
    """The fields that name an ``off`` value in their metadata, with it (see :data:`RECIPE_MARKS`)."""
    return {f.name: f.metadata["off"] for f in dataclasses.fields(cfg) if "off" in f.metadata}


def recipe_of(cfg: Any) -> dict[str, Any]:
    """The config's fields that decide what the run computes (for its hash); a field at its
    ``off`` value is left out, so adding a knob does not change the hash of the runs without it."""
    skip, off = not_recipe(cfg), off_values(cfg)
    return {k: v for k, v in dataclasses.asdict(cfg).items()
            if k not in skip and not (k in off and v == off[k])}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: the problem, then where the usage is."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (run {self.prog} --help for every option)\n")


def _join_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--lrs -0.1,0.01`` as ``--lrs=-0.1,0.01``: a value may start with '-' and still reach its field's check.

    argparse reads any '-'-prefixed token other than a plain negative number as a flag, so
    the user would hear "expected one argument" instead of what is wrong with the value.
    """
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        tok = args[i]
        action = parser._option_string_actions.get(tok)
        nxt = args[i + 1] if i + 1 < len(args) else None
        if (action is not None and action.nargs is None and action.option_strings[0].startswith("--")
                and nxt is not None and nxt.startswith("-") and not nxt.startswith("--")
                and nxt not in parser._option_string_actions):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


#: The console flags every entrypoint takes besides its config's fields (not part of the config:
#: they change what the console shows, never the result, so they stay out of its params and hash).
CONSOLE_FLAGS = ("verbose", "progress_every")


def build_parser(cls: type, *, prog: str | None = None, description: str | None = None,
                 console: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=description or (cls.__doc__ or "").strip().splitlines()[0],
    )
    fields = _fields(cls)
    if "config" not in fields:  # a config with a field of that name (the study's recipe) takes --config as it
        parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of field: value; flags override it")
    if console:
        if "verbose" not in fields:
            parser.add_argument("--verbose", dest="verbose", nargs="?", const="true", default=argparse.SUPPRESS,
                                help="show every log line of Beam, Ray and MLflow; by default the console hides "
                                     "start-up and tear-down chatter that needs no action [true or false; default: False]")
        parser.add_argument("--progress-every", dest="progress_every", metavar="SECONDS", default=argparse.SUPPRESS,
                            help="seconds between progress lines when stderr is not a terminal (a terminal gets one "
                                 "line redrawn every second); 0 turns progress off [a number; default: 15.0]")
    for name, (f, tp) in fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        shown = "required" if required else f"default: {default!r}"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                  "help": f"{help_text} [{_describe(tp)}; {shown}]".replace("%", "%%")}
        if get_origin(tp) in (list, tuple):
            kwargs["action"] = "append"
            kwargs["metavar"] = name.upper().rstrip("S") if name.endswith("s") else name.upper()
        elif tp is bool:
            kwargs["nargs"] = "?"
            kwargs["const"] = "true"
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        parser.add_argument(flag, **kwargs)
    return parser


def parse_args(cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None,
               console: dict[str, Any] | None = None) -> T:
    """Parse ``argv`` into ``cls``: config file first, then flags. Exits 2 with a one-line message on error.

    With ``console`` (a dict), the console flags (:data:`CONSOLE_FLAGS`) are accepted too and
    their values put there; a config field of the same name (``verbose``) keeps its value.
    """
    parser = build_parser(cls, prog=prog, console=console is not None)
    ns = vars(parser.parse_args(_join_dash_values(parser, sys.argv[1:] if argv is None else argv)))
    config_path = None if "config" in _fields(cls) else ns.pop("config", None)
    if console is not None:
        own = _fields(cls)
        try:
            if "progress_every" in ns and "progress_every" not in own:
                every = _coerce("progress_every", float, ns.pop("progress_every"))
                check(every >= 0, "progress_every", f"must be 0 (off) or a positive number of seconds, got {every}")
                console["progress_every"] = every
            if "verbose" in ns and "verbose" not in own:
                console["verbose"] = _coerce("verbose", bool, ns.pop("verbose"))
        except ConfigError as exc:
            parser.error(str(exc))
    try:
        data = load_file(config_path) if config_path else {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_path}: expected a mapping of field: value at the top level")
        data.update(ns)
        return from_dict(cls, data, source=config_path or prog or cls.__name__)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable; parser.error exits


def check(condition: bool, field_name: str, message: str) -> None:
    """Raise ConfigError for ``field_name`` unless ``condition``; for use in ``__post_init__``."""
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def parse_named(specs: Sequence[str], field_name: str, *, example: str,
                reserved: Mapping[str, str] | None = None) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` -> ``{NAME: VALUE}`` in order: the one rule for every ``NAME=SRC`` flag.

    Names and values are stripped and must be non-empty; a name may appear once, and a
    name in ``reserved`` is refused with the reason given there. Errors are ``ConfigError``
    naming the flag and the spec.
    """
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name, value = name.strip(), value.strip()
        check(bool(sep and name and value), field_name, f"{spec!r}: expected NAME=SRC, e.g. {example}")
        check(name not in (reserved or {}), field_name, f"{spec!r}: {(reserved or {}).get(name)}")
        check(name not in out, field_name, f"{spec!r}: {name!r} is given twice (first as {out.get(name)!r})")
        out[name] = value
    return out
