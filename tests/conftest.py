import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels (the CUDA backend's) run in Triton's interpreter on CPU tensors. triton.jit picks the
# interpreter when a kernel is decorated, so this must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from tests.paged_attention_reference import patch_interpreter_for_numpy

        patch_interpreter_for_numpy()
    except ImportError:  # triton is not installed: the tests that need it skip
        pass


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random GPT-2 / Llama (GQA) / Qwen2 / Qwen3 checkpoints written with save_pretrained."""
    from engine.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {fam: str(build_tiny_checkpoint(fam, root / fam)) for fam in ("gpt2", "llama", "qwen2", "qwen3")}
