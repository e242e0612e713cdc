"""The sampler's masks and greedy choice on hand-made logits (pure unit)."""
import torch

from core.request import Request
from core.sampling import SamplingParams
from engine.sampler import Sampler

EOS = 5


def _req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, **params))


def test_min_tokens_masks_eos_and_stop_ids_of_its_rows_only():
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.zeros(4, 12)
    logits[:, EOS] = 3.0  # EOS is every row's favourite...
    logits[:, 7] = 2.0  # ...then a stop token id...
    logits[:, 2] = 1.0  # ...then a plain token
    logits[:, 11] = 9.0  # past the tokenizer's vocabulary: never drawn
    reqs = [
        _req("plain"),  # no min_tokens: EOS stays
        _req("min", min_tokens=2, max_tokens=4),  # EOS banned
        _req("min-stop", min_tokens=2, max_tokens=4, stop_token_ids=(7, 99)),  # EOS and 7 banned, 99 out of range
        _req("min-ignore-eos", min_tokens=2, max_tokens=4, ignore_eos=True),  # EOS banned too, as in vLLM
    ]
    assert s.sample(logits, reqs) == [EOS, 7, 2, 7]


def test_min_tokens_mask_lifts_once_reached():
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    r = _req("r", min_tokens=1, max_tokens=4)
    r.token_ids = [1, 2, 3, 4]  # one output token already
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 1.0
    assert s.sample(logits, [r]) == [EOS]
