"""Stream pacing: how long a replica's stream holds its tokens before the next chunk goes out.

Every chunk costs the HTTP path the same whatever it carries: a Ray message from the replica to the Ingress, an
SSE event through the proxy. Those processes are single Python processes shared by every stream, so past some
chunks a second they fall behind, and each stream's tokens reach its client later and later, though the engine
made them in time: requests then miss their TPOT SLO at the client and not in the engine.

A stream sends its first token at once. After that it waits `hold_s` seconds since its last chunk (the tokens
made meanwhile go out together, so its mean TPOT is unchanged) and the last tokens go out as soon as it ends:
- `interval_s`: a fixed floor (`stream_interval_ms`; 0 by default, as vLLM).
- `max_chunks_per_s`: the replica's budget of chunks a second over all its streams. While one chunk per decoding
  stream per engine step stays within it, nothing is held (a lightly loaded replica streams token by token, its
  ITL untouched); past it, each of the n decoding streams holds n / `max_chunks_per_s` seconds, so together they
  send at most the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StreamPacing:
    interval_s: float = 0.0  # fixed floor between a stream's chunks after its first
    max_chunks_per_s: float = 0.0  # the replica's chunk budget over all its streams; 0: none
    # a routed app's: the Ingress replicas' budget for all LLM replicas together, which a replica splits over those
    # running as its requests say (`GenerateRequest.replicas_running`, `for_running`: an autoscaled app's count
    # moves, and a fixed one's too where `serve deploy` changes the deployment's num_replicas in place); 0: the split
    # `max_chunks_per_s` is fixed (a direct app's replicas have budgets of their own)
    shared_chunks_per_s: float = 0.0

    def for_running(self, replicas: int) -> "StreamPacing":
        """This pacing with `replicas` LLM replicas running (`shared_chunks_per_s` split over them; as it is
        without a shared budget)."""
        if self.shared_chunks_per_s <= 0 or replicas < 1:
            return self
        return replace(self, max_chunks_per_s=self.shared_chunks_per_s / replicas)

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.max_chunks_per_s < 0:
            raise ValueError(f"StreamPacing wants non-negative figures, got {self}")

    @classmethod
    def of_app(cls, stream_interval_ms: float, stream_max_chunks_s: float, num_replicas: int,
               ingress_num_replicas: int = 1, routed: bool = True,
               direct_max_chunks_s: float = 0.0, autoscaled: bool = False) -> "StreamPacing":
        """Routed: the app's budget (chunks a second through each Ingress replica) split over the LLM replicas that
        share it. Direct: there is no Ingress, each replica writes its streams to the proxy itself, a hop without
        Ray, and its own budget (`direct_max_chunks_s`) is set above a CPU replica's tokens a second (where a
        budget, binding under a burst, gained no tokens a second and only held tokens back) but under a GPU
        replica's hundreds of streams (where a chunk per token left new requests waiting for the replica's event
        loop for up to seconds). Routed, each replica splits the budget over those running as the Ingress sending
        its requests last heard (`for_running`): `num_replicas` (`autoscaled`: the most) is the split until then."""
        total = stream_max_chunks_s * ingress_num_replicas
        per = total / max(num_replicas, 1) if routed else direct_max_chunks_s
        return cls(max(0.0, stream_interval_ms) / 1000.0, max(0.0, per), max(0.0, total) if routed else 0.0)

    @property
    def holds(self) -> bool:
        """Whether a stream can ever be held (else the replica sends each token as it comes, asking nothing)."""
        return self.interval_s > 0 or self.max_chunks_per_s > 0

    def hold_s(self, streams: int, step_ms: float | None, step_batch: float | None = None) -> float:
        """Seconds a stream waits after its last chunk, with `streams` streams open on the replica, its engine
        stepping every `step_ms` (None: not known yet, taken as faster than any budget) with `step_batch`
        requests decoding on average (None: every open stream; streams still queued for prefill send nothing)."""
        hold = self.interval_s
        if step_batch is not None:
            streams = min(streams, max(1, math.ceil(step_batch)))
        if self.max_chunks_per_s > 0 and streams > 0:
            paced = streams / self.max_chunks_per_s
            if (step_ms or 0.0) / 1000.0 < paced:  # a chunk per stream per step would exceed the budget
                hold = max(hold, paced)
        return hold
