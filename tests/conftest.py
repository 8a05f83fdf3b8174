"""Shared fixtures: a private model cache with the tiny random-weight models, and in-process service stacks."""

from __future__ import annotations

import os
import tempfile

# Before any specmesh import: tests never touch the user's model cache.
os.environ.setdefault("SPECMESH_CACHE_DIR", tempfile.mkdtemp(prefix="specmesh-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return os.environ["SPECMESH_CACHE_DIR"]
