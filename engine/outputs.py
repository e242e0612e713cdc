"""Turns sampled tokens into stream items: incremental detokenization, stop strings, the final item.

The engine's worker thread owns one `OutputProcessor`; it keeps per request what the output side needs (the
stream, the detokenizer, the text so far) and never changes the `Request` itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.messages import ErrorKind, RejectReason, RequestMetrics, RequestOutput, TokenLogprob
from core.request import FinishReason, Request
from engine.detokenizer import IncrementalDetokenizer, TokenTexts
from engine.sampler import RowLogprobs
from engine.stream import OutputSink


@dataclass(slots=True)
class _Live:
    """A request's output side. With stop strings `text` is the whole reply so far (a stop string is looked for in
    it) and `emitted_chars` how much of it has gone out; without, `text` is only what has not gone out yet."""
    stream: OutputSink
    detok: IncrementalDetokenizer
    text: str = ""
    emitted_chars: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the reply (vLLM's)
    prompt: list[TokenLogprob] | None = None  # prompt logprobs so far (`add_prompt_logprobs`), until sent
    prompt_sent: bool = False  # the reply's first item has gone, with the prompt logprobs where asked


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        # the tokenizer's own EOS; the model's other EOS ids (its generation config's) are stop tokens to vLLM
        self.tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self._live: dict[str, _Live] = {}
        self.token_text = TokenTexts(tokenizer)  # a token's text alone, as logprobs name tokens

    def add(self, req: Request, stream: OutputSink) -> None:
        self._live[req.request_id] = _Live(stream, IncrementalDetokenizer(self.tokenizer,
                                                                          req.params.skip_special_tokens,
                                                                          req.prompt_token_ids))

    def open_streams(self) -> list[tuple[str, OutputSink]]:
        """(request id, stream) of every request not finished yet (the engine's watchdog fails them)."""
        return [(rid, live.stream) for rid, live in list(self._live.items())]

    def on_token(self, req: Request, tok: int, reason: FinishReason | None,
                 num_output_tokens: int | None = None, logprobs: RowLogprobs | None = None) -> FinishReason | None:
        """Detokenize `tok`, the request's `num_output_tokens`-th output token (default: its last), and check the
        stop strings (past min_tokens, as vLLM: on a token after the first min_tokens, a stop string that ends in
        its text). Emits the delta unless the request ends now; returns the request's finish reason (a stop string
        makes it STOP), or None while it goes on. A token that ends the request as a stop (the EOS, a stop token id)
        adds nothing to the text, as in vLLM without include_stop_str_in_output (nor do the bytes of a character it
        would have completed; with it, its text is the reply's last); `stop_reason` is then its id, except for the
        tokenizer's EOS (None, as vLLM's: the model's other EOS ids are stop tokens there). `logprobs`: the token's,
        where its request asks for them (a token that ends the request has them in the final item: `finish`'s
        `last_logprobs`)."""
        live = self._live[req.request_id]
        p = req.params
        if reason is FinishReason.STOP:
            if (tok in p.stop_token_ids or tok in self.eos) and not (tok == self.tokenizer_eos and not p.ignore_eos):
                live.stop_reason = tok
            if p.include_stop_str_in_output:  # vLLM's: the stop token's text stays too (the EOS's, special: none)
                live.text += live.detok.step(tok)
            return reason
        n = num_output_tokens or req.num_output_tokens
        delta = live.detok.step(tok)
        if not p.stop:  # nothing held back: the delta goes out as it is (`text`: what has not gone out yet)
            text = delta
            if reason is not None:
                live.text += delta
                return reason
        else:
            if delta:
                live.text += delta
                if n > p.min_tokens:
                    hit = _find_stop(live.text, p.stop, len(live.text) - len(delta))
                    if hit is not None:  # (vLLM's include_stop_str_in_output: the stop string stays)
                        live.text = live.text[:hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)]
                        live.stop_reason = hit[1]
                        reason = FinishReason.STOP
            if reason is not None:
                return reason
            # a stop string may still be completing (one that stays in the text holds nothing back)
            hold = 0 if p.include_stop_str_in_output else max(map(len, p.stop)) - 1
            upto = max(live.emitted_chars, len(live.text) - hold)
            text = live.text[live.emitted_chars:upto]
            live.emitted_chars = upto
        lp = self.token_logprob(tok, logprobs) if logprobs is not None else None
        live.stream.put_token(req.request_id, text, tok, len(req.prompt_token_ids), n, lp, self._prompt_out(req, live))
        return None

    def add_prompt_logprobs(self, req: Request, start: int, rows: list[RowLogprobs]) -> None:
        """A step's prompt logprobs of `req` (`Sampler.prompt_logprobs`): those of its prompt tokens start + 1 on,
        kept until its first item (`_prompt_out`)."""
        live = self._live.get(req.request_id)
        if live is None or live.prompt_sent:
            return
        if live.prompt is None:
            live.prompt = self._unpredicted(req.prompt_token_ids)
        ids = req.prompt_token_ids
        for j, row in enumerate(rows, start + 1):
            live.prompt[j] = self.token_logprob(ids[j], row)

    def _unpredicted(self, ids: list[int]) -> list[TokenLogprob]:
        """A prompt's tokens before their logprobs are in: each with a logprob of None (the first keeps it)."""
        return [TokenLogprob(t, self.token_text(t), None, 0) for t in ids]

    def _prompt_out(self, req: Request, live: _Live) -> list[TokenLogprob] | None:
        """The prompt logprobs a request's item carries: on its first item that carries a token, where it asks for
        them."""
        if req.params.prompt_logprobs is None or live.prompt_sent:
            return None
        live.prompt_sent = True
        out = live.prompt if live.prompt is not None else self._unpredicted(req.prompt_token_ids)
        live.prompt = None
        return out

    def token_logprob(self, tok: int, lp: RowLogprobs) -> TokenLogprob:
        """Token `tok`'s log-probabilities as its stream carries them (`RowLogprobs`, the sampler's), its tokens as
        text."""
        value, rank, top = lp
        text = self.token_text
        return TokenLogprob(tok, text(tok), value, rank, tuple((t, text(t), v) for t, v in top))

    def finish(self, req: Request, *, reject_reason: RejectReason | None = None, error: str | None = None,
               error_kind: ErrorKind | None = None, last_token: int | None = None,
               last_logprobs: RowLogprobs | None = None) -> None:
        """Send the final item of a request the scheduler has just ended (`req.finish_reason` is set), with the token
        that ended it (`last_token`) and its log-probabilities where its request asks for them."""
        live = self._live.pop(req.request_id)
        reason = req.finish_reason
        if reason is not FinishReason.STOP:  # a stop (a string, or a token: `on_token`) leaves a partial out
            live.text += live.detok.flush()
        text = live.text[live.emitted_chars:]
        logprobs = None  # (a token without them, which no draw makes, leaves them out of the item)
        if req.params.logprobs is not None and (last_token is None) == (last_logprobs is None):
            logprobs = [] if last_logprobs is None else [self.token_logprob(last_token, last_logprobs)]
        live.stream.put(RequestOutput(
            req.request_id, text=text, token_ids=[] if last_token is None else [last_token], finished=True,
            finish_reason=reason, reject_reason=reject_reason, error=error,
            stop_reason=live.stop_reason if reason is FinishReason.STOP else None,
            planned_output_len=req.gate_output_len if reject_reason is not None else None,
            error_kind=error_kind if reason is FinishReason.ERROR else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            metrics=RequestMetrics(req.arrival_s, req.admitted_s, req.first_token_s, req.finished_s,
                                   req.token_times, _planned_len(req), req.num_cached_tokens), logprobs=logprobs,
            prompt_logprobs=self._prompt_out(req, live) if last_token is not None else None))


def _planned_len(req: Request) -> int | None:
    """The reply length the scheduler planned for at the request's arrival from its length predictor's prediction:
    that prediction within max_tokens (None where it predicted none)."""
    return None if req.predicted_len is None else min(req.predicted_len, req.params.max_tokens)


def _find_stop(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The first stop string, in the request's order, found ending inside the newly added text (as vLLM's
    check_stop_strings: where one token completes two, the one listed first ends the reply), and its index."""
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1:
            return i, s
    return None
