"""The trained default model (SmolLM2-135M-Instruct, converted once from the wheel's GGUF): real answers,
greedy tokens equal to HF `generate` on chat prompts in fp32, and chat that ends at `<|im_end|>`."""
from __future__ import annotations

import pytest
import torch

from core.messages import ChatTurn
from core.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    eng = LLMEngine(EngineConfig(model="kairos-default", dtype="float32", device="cpu",
                                 scheduler=SchedulerConfig(policy="fcfs")))
    yield eng
    eng.shutdown()


def _chat(eng, question: str, max_tokens: int | None = MAX_TOKENS):
    outs = list(eng.add_request(None, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                messages=[ChatTurn("user", question)]))
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1]


def test_default_model_is_the_trained_smollm2(engine):
    cfg = engine.bundle.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and engine.bundle.dtype == torch.float32
    tok = engine.tokenizer
    assert engine.bundle.eos_token_ids[:2] == [tok.convert_tokens_to_ids("<|im_end|>"),
                                               tok.convert_tokens_to_ids("<|endoftext|>")]
    assert "<|im_start|>" in tok.chat_template


def test_answers_the_capital_of_france(engine):
    text, _, last = _chat(engine, "What is the capital of France?", max_tokens=None)
    assert text == "The capital of France is Paris."
    assert last.finish_reason == "stop" and "<|im_end|>" not in text


def test_greedy_chat_tokens_equal_hf_generate(engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.bundle.path, dtype=torch.float32).eval()
    tok, eos = engine.tokenizer, engine.bundle.eos_token_ids
    for q in PROMPTS:
        text, ours, last = _chat(engine, q)
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        ref = out[0, ids.shape[1]:].tolist()
        assert ours == ref, q
        stopped = ref[-1] in eos
        assert last.finish_reason == ("stop" if stopped else "length"), q
        assert "<|im_end|>" not in text
