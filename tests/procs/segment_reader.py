"""Holds a segment open (its shared lock) until stdin closes: a reader for collector tests.

python segment_reader.py SEGMENT_PATH
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.store.segment import Segment


def main() -> None:
    with Segment.open(sys.argv[1]) as seg:
        print(f"holding {seg.segment_id}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
