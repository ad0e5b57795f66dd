"""Label values as text: one definition for the flat report keys and the Prometheus labels.

Every label value (a string, or None where a batch gave no label) becomes a *label text*, so two
different slices can never share a key or a series:

* ``None`` is ``%null``; the empty string is ``%empty``; the merged remainder beyond the label
  limit (``label_limits.py``) is ``%other``. A ``%`` followed by a lowercase letter is only ever
  one of these markers.
* any other string is itself, except that ``%``, ``/`` and characters that are not printable
  (controls, line breaks, lone surrogates) are written as ``%XX`` per UTF-8 byte, in uppercase
  hex: ``fp8`` stays ``fp8``, ``a/b`` is ``a%2Fb``, ``50%`` is ``50%25``, ``Grüße`` stays as is.

So the text is never empty (Prometheus reads ``pool=""`` as "no label", i.e. the fleet series)
and never contains ``/``, and :func:`parse_label_text` inverts it. ``report_keys.py`` builds
the report keys from these texts; ``label_limits.py`` merges the values beyond the limit.
"""

from __future__ import annotations

import re

NULL_TEXT = "%null"     # a label that was not given
EMPTY_TEXT = "%empty"   # the empty string
OTHER_TEXT = "%other"   # every label value beyond the limit, merged
_MARKERS = {NULL_TEXT: None, EMPTY_TEXT: ""}
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def _escape(ch: str) -> str:
    if ch != "%" and ch != "/" and ch.isprintable():
        return ch
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def label_text(value: str | None) -> str:
    """The label text of one label value (see the module docstring): injective, never empty."""
    if value is None:
        return NULL_TEXT
    if value == "":
        return EMPTY_TEXT
    value = str(value)
    if value.isprintable() and "%" not in value and "/" not in value:   # the common case, in C
        return value
    return "".join(_escape(ch) for ch in value)


def parse_label_text(text: str) -> str | None:
    """The label value a label text was made from; ValueError for ``%other`` or malformed text."""
    if text in _MARKERS:
        return _MARKERS[text]
    if text == OTHER_TEXT:
        raise ValueError("%other is the merged remainder of several label values, not one value")
    if "/" in text or re.search(r"%(?![0-9A-F]{2})", text):
        raise ValueError(f"not a label text: {text!r}")
    raw = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(text):
        raw += text[pos:m.start()].encode("utf-8", "surrogatepass") + bytes([int(m.group(1), 16)])
        pos = m.end()
    raw += text[pos:].encode("utf-8", "surrogatepass")
    value = raw.decode("utf-8", "surrogatepass")
    if label_text(value) != text:   # e.g. an escape of a character that is written as itself
        raise ValueError(f"not a label text: {text!r}")
    return value
