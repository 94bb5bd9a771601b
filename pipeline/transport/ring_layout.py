"""A ring record's payload layout: the arrays one `Ring.put` writes back to back, each at an
8-byte aligned offset, and the zero-copy views a consumer reads them back as
(pipeline/transport/ring.py; the records themselves: pipeline/transport/ring_records.py).
"""

from __future__ import annotations

import numpy as np

from pipeline.core.errors import RingError


def align8(nbytes: int) -> int:
    """nbytes rounded up to a multiple of 8."""
    return (nbytes + 7) & ~7


def record_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of arrays of these byte sizes inside a put() payload, and its length."""
    offsets = []
    position = 0
    for size in sizes:
        position = align8(position)
        offsets.append(position)
        position += size
    return offsets, position


def record_arrays(payload: memoryview, *layout: tuple[np.dtype | str, tuple[int, ...] | int]):
    """Zero-copy numpy views of the arrays a put() wrote, given their (dtype, shape) in order.

    The views are read-only and valid until the consumer's next release().
    """
    dtypes = [np.dtype(dtype) for dtype, _ in layout]
    shapes = [(shape,) if isinstance(shape, int) else tuple(shape) for _, shape in layout]
    sizes = [
        dtype.itemsize * int(np.prod(shape)) for dtype, shape in zip(dtypes, shapes, strict=True)
    ]
    offsets, length = record_layout(sizes)
    if length != payload.nbytes:
        raise RingError(
            f"record payload is {payload.nbytes} bytes but the layout {layout!r} needs {length}; "
            "the consumer must name the same arrays, in order, as the producer's put()"
        )
    return [
        np.frombuffer(payload, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape)
        for dtype, shape, size, offset in zip(dtypes, shapes, sizes, offsets, strict=True)
    ]
