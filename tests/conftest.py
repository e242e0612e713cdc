import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random GPT-2 / Llama (GQA) / Qwen2 / Qwen3 checkpoints written with save_pretrained."""
    from engine.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {fam: str(build_tiny_checkpoint(fam, root / fam)) for fam in ("gpt2", "llama", "qwen2", "qwen3")}
