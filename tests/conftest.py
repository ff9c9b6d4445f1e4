"""Fixtures shared by every test folder: the tiny model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_asyncppo.config import DataConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.tasks import load_task


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default task's tiny Llama and tokenizer, saved in HF format."""
    out = tmp_path_factory.mktemp("tiny_model")
    return build_tiny_model(out, load_task(DataConfig()).vocabulary(), TinyModelConfig(), seed=3)
