"""How long an idle stage loop may wait for a wakeup before it looks at its rings itself.

The router and the writers wake on the message each ring put sends
(pipeline/transport/outlet.py), but a wakeup can be lost while a neighbour stage
restarts, so an idle loop looks at its rings on its own too: every `short_ms`
at first, so that a lost wakeup costs a busy pipeline little; once the loop
has been idle for `after_s`, the wait doubles at each idle step up to
`long_ms`, so that an idle broker does not wake 20 times a second per stage.
Work puts it back to `short_ms`.
"""

from __future__ import annotations


class IdleWait:
    def __init__(self, short_ms: int = 50, long_ms: int = 400, after_s: float = 2.0) -> None:
        self.short_ms = short_ms
        self.long_ms = long_ms
        self.after_s = after_s
        self._idle_since: float | None = None
        self._ms = short_ms

    def busy(self) -> None:
        """The loop had work: the next idle wait is short again."""
        self._idle_since = None
        self._ms = self.short_ms

    def wait_ms(self, now: float) -> int:
        """The wait for this idle step (`now`: monotonic seconds)."""
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since >= self.after_s:
            self._ms = min(self.long_ms, self._ms * 2)
        return self._ms
