from __future__ import annotations

import pytest

from tests.replicas.models.checkpoints import save_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(variant)`` -> (directory, transformers model), each saved once."""
    saved = {}

    def get(variant: str):
        if variant not in saved:
            directory = tmp_path_factory.mktemp(variant)
            saved[variant] = (directory, save_checkpoint(variant, directory))
        return saved[variant]

    return get
