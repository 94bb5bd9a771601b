"""One root exception for the whole broker, with a family per subsystem.

Every message names the offending value, where it came from (file, line,
field) and what to do about it. Third-party errors (OSError, zmq.ZMQError,
tomllib.TOMLDecodeError) are translated into these at the boundary.
"""

from __future__ import annotations


class FabricError(Exception):
    """Root of every error the broker raises on purpose."""


class ConfigError(FabricError):
    """A configuration file or value is invalid; the message says which and how to fix it."""


class SegmentError(FabricError):
    """A segment file cannot be used as asked."""


class SegmentFormatError(SegmentError):
    """A segment file is not one this version can read (magic, version, checksum, size).

    `code` names the finding for `check`: bad-magic, bad-version, bad-header,
    wrong-size.
    """

    def __init__(self, message: str, code: str = "bad-header") -> None:
        super().__init__(message)
        self.code = code


class SegmentFullError(SegmentError):
    """An append asked for more slots than the segment has left; rotate first."""


class SegmentSealedError(SegmentError):
    """An append was attempted on a sealed segment."""


class DiskFullError(SegmentError):
    """The disk under the data dir is full (ENOSPC). Retryable once space is freed."""

    retryable = True


class DataDirLockedError(FabricError):
    """Another process holds the data dir's exclusive lock."""
