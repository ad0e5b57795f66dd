"""A small, deterministic YAML writer for the files this package renders.

Only mappings, lists, strings, numbers and booleans occur in rule, test and Alertmanager files.
Every string is quoted, so no value can change meaning (``'true'``, ``'1e-3'``, ``'on'`` stay
strings): single-quoted (only ``'`` is escaped, as ``''``) when it is printable ASCII, which keeps
PromQL readable, otherwise as a JSON string, which is a valid double-quoted YAML scalar. Keys
that are plain identifiers are left bare.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) and k not in ("true", "false", "null", "yes", "no", "on", "off") \
        else json.dumps(k)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"expected a finite number, got {v}")
        return repr(v)
    if isinstance(v, str):
        if all(" " <= c <= "~" for c in v):
            return "'" + v.replace("'", "''") + "'"
        return json.dumps(v)
    raise TypeError(f"expected a str, number or bool, got {type(v).__name__}")


def _lines(v: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(v, dict):
        for k, item in v.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{_key(k)}:")
                out += _lines(item, indent + 2)
            else:
                out.append(f"{pad}{_key(k)}: {_empty_or_scalar(item)}")
    elif isinstance(v, list):
        for item in v:
            if isinstance(item, (dict, list)) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_empty_or_scalar(item)}")
    else:
        out.append(pad + _scalar(v))
    return out


def _empty_or_scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)


def dump(document: dict[str, Any], header: str = "") -> str:
    """``document`` as YAML text, preceded by ``header`` lines as comments."""
    comments = [f"# {line}".rstrip() for line in header.splitlines()] if header else []
    return "\n".join(comments + _lines(document, 0)) + "\n"
