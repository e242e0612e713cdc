"""The trained default model over HTTP, deployed exactly as `serve run deployments:app` does (no arguments):
the official `openai` client gets "Paris" back for the capital of France, and chat ends with `stop`."""
from __future__ import annotations

import pytest

from tests.serve.conftest import BASE_URL

PREFIX = "/default"


@pytest.fixture(scope="module")
def default_url(serve_app: dict):
    from ray import serve
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_builds

    import deployments

    serve.run(serve_builds(deployments.app, {}), name="kairos-default-app", route_prefix=PREFIX, blocking=False)
    try:
        yield BASE_URL + PREFIX
    finally:
        serve.delete("kairos-default-app")


def test_openai_client_chat_answers_paris(default_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_url}/v1", api_key="unused", timeout=120)
    models = client.models.list()
    assert [m.id for m in models.data] == ["kairos-default"]
    chat = client.chat.completions.create(
        model="kairos-default", temperature=0, max_completion_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = chat.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    stream = client.chat.completions.create(
        model="kairos-default", temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
