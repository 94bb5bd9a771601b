"""Which numpy dtypes may cross the wire, and their metadata form.

A dtype is a numpy dtype string from ALLOWED_DTYPES or `|V<bytes>`, or a
structured dtype as a list of `[field name, dtype string]` pairs (numpy's
`descr`; padding fields have the name ""). Anything else is refused with a
WireError naming where it was found.
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.core.errors import WireError
from pipeline.transport.wire.messages import DEFAULT_LIMITS, MAX_NAME_CHARS, WireLimits, show

ALLOWED_DTYPES = frozenset(
    {"|u1", "<u1", "|i1", "<i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"}
)
_VOID_RE = re.compile(r"[|<]V([1-9][0-9]{0,5})\Z")  # raw bytes, 1..999999 per element


def _scalar_dtype(spec: object) -> np.dtype | None:
    if not isinstance(spec, str):
        return None
    if spec in ALLOWED_DTYPES or _VOID_RE.match(spec):
        return np.dtype(spec)
    return None


def dtype_to_wire(dtype: np.dtype, where: str = "array") -> str | list[list[str]]:
    """The metadata form of an allowed dtype; WireError naming `where` for any other."""
    if dtype.names is None:
        wire = dtype.str
        if dtype.subdtype is None and _scalar_dtype(wire) is not None:
            return wire
    else:
        fields = []
        for entry in dtype.descr:
            if len(entry) != 2 or not isinstance(entry[0], str) or _scalar_dtype(entry[1]) is None:
                break
            fields.append([entry[0], entry[1]])
        else:
            try:  # the wire form must rebuild the same layout (numpy adds no hidden padding)
                rebuilt = np.dtype([(name, fmt) for name, fmt in fields])
                same = rebuilt.itemsize == dtype.itemsize and all(
                    rebuilt.fields[name][1] == spec[1] for name, spec in dtype.fields.items()
                )
            except (TypeError, ValueError, KeyError):
                same = False
            if same:
                return fields
    raise WireError(
        f"{where}: dtype {dtype!r} cannot go on the wire: use little-endian {sorted(ALLOWED_DTYPES)}, "
        "|V<n>, or a flat structured dtype of those (no sub-arrays, titles or objects)"
    )


def dtype_from_wire(spec: object, where: str, limits: WireLimits = DEFAULT_LIMITS) -> np.dtype:
    """The numpy dtype a metadata dtype names; WireError naming `where` if it is not allowed."""
    dtype = _scalar_dtype(spec)
    if dtype is not None:
        return dtype
    if isinstance(spec, list) and 0 < len(spec) <= limits.max_fields:
        fields = []
        for entry in spec:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and len(entry[0]) <= MAX_NAME_CHARS
                and _scalar_dtype(entry[1]) is not None
            ):
                raise WireError(
                    f"{where}: structured dtype field {show(entry)} is not [name, dtype]"
                )
            fields.append((entry[0], entry[1]))
        try:
            return np.dtype(fields)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{where}: structured dtype {show(spec)} is invalid: {exc}") from exc
    raise WireError(
        f"{where}: dtype {show(spec)} is not allowed; use one of {sorted(ALLOWED_DTYPES)}, "
        f"|V<n>, or a list of at most {limits.max_fields} [name, dtype] pairs"
    )
