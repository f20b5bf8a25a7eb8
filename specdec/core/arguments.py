"""Checking a part's arguments against its signature, and building a part by its short name.

Every pluggable part (a verifier, a schedule, a prompt source, a tracker) is a class or function
called with keyword arguments. Before anything runs, the arguments a user gave are checked against
what it takes (names, required ones, scalar types), so that `verifier_args.eps=0.1` fails with the
names it does take, not deep inside a generation. The core names its built-in parts with plain dicts
(`build_named`); the study layer builds parts from files with the same checks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["build_named", "check_args", "check_arguments", "scalar_types", "takes", "type_problem", "wrong_types"]


def check_args(target: Any, label: str, args_key: str, given: Iterable[str], passed: Iterable[str] = (),
               fixed: Iterable[str] = (), structure: Iterable[str] = ()) -> None:
    """The user's arguments (`given`, from `args_key`) must be ones `target` takes, other than those the
    caller `passed` and the file's `structure` (nested nodes); with the file's `fixed` values, every
    required argument must be set. Messages name what the target takes."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    given, reserved = set(given), set(passed) | set(structure)
    takes = [n for n, p in params.items() if n not in reserved and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(given - set(takes))
    if unknown:
        offer = f"; it takes: {', '.join(takes)}" if takes else ""
        raise ValueError(f"{label} takes no {args_key} {unknown}{offer}")
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
               and n not in given | reserved | set(fixed)]
    if missing:
        raise ValueError(f"{label} needs {', '.join(f'{args_key}.{n}' for n in missing)}")


def takes(target: Any, name: str) -> bool:
    """Whether `target` accepts a keyword argument `name`."""
    params = inspect.signature(target).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def scalar_types(target: Any) -> dict[str, tuple[type, bool]]:
    """Parameter -> (int, float, bool or str; whether None is allowed) for the parameters of
    `target` annotated with one of those scalars (or one of them | None). Others are not listed."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # an annotation that does not resolve here: nothing to check against
        return {}
    out = {}
    for name, hint in hints.items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _SCALARS:
            out[name] = (kinds[0], type(None) in args)
    return out


def type_problem(value: Any, kind: type, optional: bool = False) -> str | None:
    """What is wrong with `value` as a `kind` (int, float: any number, bool or str; None allowed when
    `optional`), else None. A bool is not a number here."""
    if value is None and optional:
        return None
    fits = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if fits and not (kind in (int, float) and isinstance(value, bool)):
        return None
    return f"must be {_SCALARS[kind]}{' or null' if optional else ''}, got {value!r} ({type(value).__name__})"


def wrong_types(target: Any, values: Mapping) -> tuple[str, str] | None:
    """The first (name, message) among `values` whose type `target`'s annotation rules out, else None:
    `max_ngram=abc` fails before any model loads, not as a comparison of int and str after."""
    types = scalar_types(target)
    for name, value in values.items():
        problem = type_problem(value, *types[str(name)]) if str(name) in types else None
        if problem:
            return str(name), problem
    return None


def check_arguments(target: Any, label: str, key: str, args: Mapping, passed: Iterable[str] = (),
                    fixed: Iterable[str] = (), structure: Iterable[str] = ()) -> None:
    """The user's `<key>_args` against what `target` takes: names and required ones (`check_args`),
    then scalar types (`wrong_types`); a ValueError names the first argument that cannot work."""
    check_args(target, label, f"{key}_args", args, passed, fixed, structure)
    wrong = wrong_types(target, args)
    if wrong:
        raise ValueError(f"{key}_args.{wrong[0]}: {wrong[1]}")


def build_named(kind: str, table: Mapping[str, Callable], name: str, args: Mapping | None = None,
                **passed: Any) -> Any:
    """`table[name](**passed, **args)`, with `args` (the user's `<kind>_args`) checked first; a name
    not in `table` fails with the names that are."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(table))}")
    factory, args = table[name], dict(args or {})
    check_arguments(factory, f"{kind}={name}", kind, args, passed)
    return factory(**passed, **args)
