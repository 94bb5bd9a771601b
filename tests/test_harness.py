"""The test harness itself: what it does where a test's capability is missing."""

from __future__ import annotations

import pytest
from conftest import skip_or_fail


def test_a_missing_capability_skips_here_and_fails_where_ci_is_set(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_or_fail("needs root")
    monkeypatch.setenv("CI", "true")  # as GitHub Actions and most CI services set it
    with pytest.raises(pytest.fail.Exception, match="needs root; CI is set"):
        skip_or_fail("needs root")
