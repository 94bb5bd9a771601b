"""What the broker says on its terminal (stderr): for people, not for programs.

| when                          | lines                                                     |
|-------------------------------|-----------------------------------------------------------|
| the pre-start checks passed   | `serving DATA_DIR (logs in DIR)`, then one line per port it listens on (pipeline/transport/binds.py): what it is for, its address and its setting; the models with their engine and endpoints, and the lanes |
| every stage reported up       | `ready`                                                   |
| a stage died before it was up | `stage LABEL died at start (HOW): LAST ERROR LINE OF ITS LOG` |
| SIGTERM or Ctrl-C, stopped    | `drained, N items left queued, stopped`                   |

Programs read the broker's state from `status`, metrics and files; these
lines may change wording.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.transport.binds import bound


def say(line: str) -> None:
    print(f"fabric: {line}", file=sys.stderr, flush=True)


def start_lines(settings) -> list[str]:
    lines = [f"serving {settings.data_path} (logs in {settings.data_path / 'log'})"]
    for bind, address in bound(settings):
        lines.append(f"  {bind.purpose:30} {address}  ({bind.setting})")
    for model in settings.models:
        tokens = "text and token ids" if model.tokenizer else "token ids only"
        lines.append(
            f"  model {model.name}: engine {model.engine}, {', '.join(model.endpoints)}, "
            f"{tokens}, up to {model.max_tokens} tokens"
        )
    lines.append(f"  lanes (tokens): {', '.join(str(n) for n in settings.broker.lanes)}")
    return lines


def left_queued(segments_dir: Path) -> int:
    """Items still LIVE in the input log: queued or leased, not yet finished."""
    from pipeline.store.scan import scan_segment

    live = 0
    for path in sorted(segments_dir.glob("in-*.seg")):
        summary = scan_segment(path)
        live += getattr(summary, "live", 0)  # a damaged file: `check` reports it
    return live
