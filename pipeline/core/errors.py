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


class DiskFullError(FabricError):
    """The disk under the data dir is full (ENOSPC, EDQUOT): a segment, a job's files, the
    dispatch file or a mark could not be written. Not a SegmentError: nothing is wrong with
    any file, and a handler of damaged segments must not take it for one. Retryable once
    space is freed."""

    retryable = True


class DataDirLockedError(FabricError):
    """Another process holds the data dir's exclusive lock."""


class OutputError(FabricError):
    """An output file or directory a command was told to write cannot be written (a read-only
    or full file system, no permission, a file where a directory should be)."""


class IngestError(FabricError):
    """Input a producer submitted cannot be taken as asked (a file, a stream, a tokenizer)."""


class InputLineError(IngestError):
    """One input line is invalid and strict mode refuses the file.

    `line` is the 1-based line number, `custom_id` the line's custom_id when
    it could be read (else None), `code` the error code from
    docs/input-format.md; the message names all three and what to do.
    """

    def __init__(self, message: str, *, line: int, custom_id: str | None, code: str) -> None:
        super().__init__(message)
        self.line = line
        self.custom_id = custom_id
        self.code = code


class TokenizerError(IngestError):
    """A model's tokenizer is not configured, missing, unreadable, or cannot render chat."""


class RingError(FabricError):
    """A shared-memory ring cannot be created, attached or used as asked."""


class WireError(FabricError):
    """A message cannot be encoded, or frames that arrived are not a valid message.

    `route` holds the ROUTER routing frames of the sender when they were
    known, so a front can answer a malformed request with an ERROR.
    """

    def __init__(self, message: str, route: tuple[bytes, ...] = ()) -> None:
        super().__init__(message)
        self.route = route


class SendTimeoutError(WireError):
    """A send did not finish within the socket's SNDTIMEO (peer gone or its queue full).

    Retryable: back off and send again, or drop the peer.
    """

    retryable = True


class BrokerUnavailableError(FabricError):
    """No broker answered a client within the tries allowed, or a request kept failing
    retryably (a full disk): exit code 6. What the broker acknowledged is durable; running
    the same command again resumes (pipeline/transport/broker_client.py)."""

    retryable = True
