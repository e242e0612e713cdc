"""`AppArgs`: the typed, flat argument set of `serve run deployments:build_app key=value ...`.

Serving knobs are declared here; every `EngineConfig` and `SchedulerConfig` field is merged in under its own
flat name (`model=...`, `num_kv_blocks=...`, `policy=...`, `prefill_max_tokens=...`), with its type, default and
constraints copied from those classes, so new engine/scheduler knobs become reachable without edits here.
`engine_config()` maps the flat names back into the nested configs. Unknown names fail with a clear message.
"""
from __future__ import annotations

import difflib
import functools
import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from engine.config import EngineConfig, check_local_model, for_device
from scheduling.config import SchedulerConfig

_ENGINE_FIELDS = tuple(n for n in EngineConfig.model_fields if n != "scheduler")
_SCHED_FIELDS = tuple(SchedulerConfig.model_fields)
_CLASH = set(_ENGINE_FIELDS) & set(_SCHED_FIELDS)
assert not _CLASH, f"engine and scheduler knobs share names {_CLASH}; AppArgs needs them distinct"
# how long a request waits for an app scaled to zero to start an LLM replica (`unready_wait_s`'s default there): the
# OpenAI client's own default timeout, as a cold start may wait for a node, then load and profile the model
COLD_START_WAIT_S = 600.0



def _unknown_names(given: Any, known: set[str]) -> str:
    """The names of `given` not in `known`, each with the near known one where there is one; "" where none."""
    hints = []
    for k in given:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)

class ServeArgs(BaseModel):
    """Serving (Ray Serve / HTTP) knobs; the engine and scheduler knobs are added by `AppArgs`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # replicas and resources
    num_replicas: int | None = Field(None, ge=1, le=1024, description="LLM replicas (one engine each); default: "
                                     "one per GPU (each `num_gpus` of them) where the replicas take GPUs, else 1")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per LLM replica (0: on CPU; 1: a GPU each; a "
                                   "fraction shares one); default: 1 where Ray has GPUs to give (`gpus_for_app`), "
                                   "at least num_replicas of them, and `device` is auto or cuda (or where "
                                   "accelerator_type is given), else 0")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve's autoscaling of the LLM replicas, in place of num_replicas (min_replicas, "
        "max_replicas, target_ongoing_requests, delays: Serve's AutoscalingConfig). min_replicas 0 scales to zero "
        "(routed topology): after downscale_to_zero_delay_s (else downscale_delay_s) with no request in flight the "
        "last replica stops, /health stays 200, and the next request starts one and waits for it (at most "
        "unready_wait_s). target_ongoing_requests left "
        "out is a replica's max_num_seqs (Serve's own default, 2, would add a replica for a third request); the "
        "policy left out is Kairos's, Serve's rule or more where the replicas turn requests away for their load "
        "(deployments/autoscaling.py); the "
        "app is sized for max_replicas (routed topology where it exceeds 1; CPU threads split over that many; the "
        "Ingress's chunk budget split over those running, as each replica hears with its requests)")
    graceful_shutdown_timeout_s: float | None = Field(
        None, ge=0, description="how long Serve lets an LLM replica it stops (a scale-down, a redeploy) finish its "
        "requests before it is killed (their streams cut off); default 20 s, and 600 s for an app that "
        "autoscales (a scale-down stops a replica that may be streaming a long reply)")
    num_cpus: float = Field(0, ge=0, description="CPUs reserved per replica (0 lets replicas pack on small boxes)")
    accelerator_type: str | None = Field(None, description="the accelerator the LLM replicas need, as Ray names it "
                                         "(H100, A10G, ...: Ray's actor option, Ray Serve LLM's accelerator_type); "
                                         "a replica then takes a GPU unless num_gpus says otherwise")
    runtime_env: dict[str, Any] | None = Field(None, description="the LLM replicas' Ray runtime_env (env_vars, ...), "
                                               "as Ray Serve LLM's runtime_env")
    max_ongoing_requests: int | None = Field(None, ge=1, description="per-LLM-replica cap enforced by the caller's "
                                             "router; default: what its engine holds, max_num_seqs + max_waiting, "
                                             "and at least 256")
    max_queued_requests: int = Field(1024, ge=-1, description="requests queued in the ingress's handle beyond "
                                     "the replicas' caps before answering 429 (-1: unbounded; 0 is not a value Serve "
                                     "takes)")
    ingress_max_ongoing_requests: int = Field(1_000_000, ge=1, description="per-ingress-replica cap (keep high)")
    ingress_num_replicas: int = Field(1, ge=1)
    # topology / routing / health / metrics
    topology: Literal["auto", "routed", "direct"] = Field(
        "auto", description="routed: an Ingress deployment sends each request to an LLM replica through a Serve "
        "handle, picked by `router`; direct: the LLM replicas serve HTTP themselves (HAProxy balances them; no "
        "extra hop, see deployments/direct.py); auto: direct with one LLM replica and one Ingress replica "
        "(ingress_num_replicas), routed with more or where autoscaling_config's min_replicas is 0")
    router: Literal["slo", "pow2"] = Field("slo", description="slo: Kairos SLO-aware router; pow2: Ray's default, "
                                           "power of two choices (passing over replicas that failed the request "
                                           "or whose engine is dead)")
    llm_transport: Literal["grpc", "ray"] = Field(
        "grpc", description="routed topology: how the Ingress streams a request's tokens from its LLM replica. grpc: "
        "Serve's inter-deployment gRPC (each stream an HTTP/2 stream; a caller that stops reading stalls only its "
        "own streams); ray: Ray actor calls, whose streaming generators end by waiting on the replica's event loop "
        "until the caller has acknowledged every item, so that one Ingress replica that hangs (a pause, a network "
        "partition) stalls every LLM replica it has streams on")
    routing_stats_period_s: float = Field(1.0, gt=0)
    reroute_rejected: int = Field(0, ge=0, le=16, description="router=slo with several replicas: a request a "
                                  "replica turns away for its SLOs or its load (429) is sent on to another replica "
                                  "this many times, with its TTFT SLO less the time spent, before the client gets "
                                  "the 429 (Ray's pow2 router cannot avoid a replica; routed topology only). Off by default: on a small "
                                  "box most rerouted requests were turned away again and the extra calls cost "
                                  "goodput")
    metrics_interval_s: float = Field(0.5, gt=0, description="engine gauge refresh period")
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # HTTP surface
    served_model_name: str | None = Field(None, description="name in /v1/models (default: the model argument)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger bodies get 413 before any parsing")
    api_keys_env: str | None = Field(None, description="env var holding comma-separated API keys (Bearer auth)")
    api_key_file: str | None = Field(None, description="file with one API key per line (Bearer auth)")
    retry_after_s: int = Field(1, ge=1, description="minimum Retry-After on 429/503")
    allowed_origins: str = Field("*", description="CORS: comma-separated origins a browser page may call the API "
                                 "from, any method and header ('*', vLLM's default: any origin); empty: no CORS "
                                 "headers, browsers then refuse cross-origin calls")
    allow_credentials: bool = Field(False, description="CORS: browsers may send cookies and Authorization with "
                                    "cross-origin calls from the origins allowed_origins lists (vLLM's "
                                    "--allow-credentials; with '*', a refusal)")
    tool_call_parser: Literal["auto", "none", "hermes", "qwen3_coder", "llama3_json", "mistral"] = Field(
        "auto", description="how a chat reply's own tool calls are read where a request with tools leaves the "
        "choice to the model (tool_choice auto, OpenAI's default): the model's format, as vLLM's "
        "--tool-call-parser names it (hermes: <tool_call> JSON, Qwen2.5/Qwen3; qwen3_coder: <tool_call> with "
        "<function=...> and <parameter=...>, Qwen3-Coder; llama3_json: a JSON object, "
        "Llama 3.x; mistral: [TOOL_CALLS]); auto: the one its chat template shows; none (or a template that shows "
        "none): such requests get a 400")
    enable_prompt_tokens_details: bool = Field(
        False, description="each usage has OpenAI's `prompt_tokens_details` with `cached_tokens`, the prompt tokens "
        "found in the prefix cache (vLLM's --enable-prompt-tokens-details)")
    allow_runtime_lora_updating: bool = Field(
        default_factory=lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        description="vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (which sets its default): POST /v1/load_lora_adapter "
        "and /v1/unload_lora_adapter add and remove LoRA adapters while the app serves (enable_lora with it). "
        "The app's one front replica keeps the list: with ingress_num_replicas above 1 (or topology=direct and "
        "several replicas) it is refused")
    trust_request_chat_template: bool = Field(
        False, description="a chat request's own `chat_template` is rendered (in transformers' sandbox) in place of "
        "the model's, as vLLM's --trust-request-chat-template; off: such a request gets a 400. The sandbox keeps a "
        "template from files and code, not from the replica's CPU and memory (a loop in a loop, a string times a "
        "billion): turn it on only for clients trusted with those")
    reasoning_parser: Literal["none", "deepseek_r1", "qwen3"] = Field(
        "none", description="how a reasoning model's thinking (<think> ... </think>) is read out of a chat reply and "
        "given as `reasoning_content`, as vLLM's --reasoning-parser: deepseek_r1: from the reply's start (its "
        "template opens <think> in the prompt: DeepSeek-R1, QwQ); qwen3: where the reply opens with <think> "
        "(Qwen3); none: the thinking stays in the content")
    unready_wait_s: float | None = Field(None, ge=0, description="routed topology: how long a request waits at the "
                                         "Ingress while no LLM replica can serve (none has loaded its model yet, "
                                         "Serve is replacing them, or the app scaled to zero and is starting one) "
                                         "before it gets a 503 `unavailable` with Retry-After; default 30 s, and "
                                         f"{COLD_START_WAIT_S:.0f} s for an app that scales to zero (a cold start "
                                         "loads the model, and may wait for a node)")
    stream_interval_ms: float = Field(0.0, ge=0, le=1000, description="stream batching: after the first token, "
                                      "send at most one chunk per request per interval, merging the tokens "
                                      "generated meanwhile; the final tokens go out as soon as the request ends. "
                                      "0 (as vLLM): every token at once; 20 ms floors the ITL at 20 ms once steps "
                                      "are faster. Ray Serve LLM uses 50 ms")
    stream_max_chunks_s: float = Field(2000.0, ge=0, description="stream pacing, routed topology: the chunks a "
                                       "second each Ingress replica relays for all streams (shared by the LLM "
                                       "replicas behind it). While one chunk per decoding stream per engine step stays "
                                       "within it every token goes out at once; past it each stream merges its "
                                       "tokens into fewer chunks (mean TPOT unchanged), so the Ingress and proxy "
                                       "do not fall behind the engines (deployments/pacing.py). 0: no budget")
    direct_max_chunks_s: float = Field(5000.0, ge=0, description="stream pacing, direct topology: the chunks a second "
                                       "each LLM replica writes to the HTTP proxy for all its streams. Its own event "
                                       "loop writes them and takes each new request; on a GPU's hundreds of streams a "
                                       "chunk per token falls behind, and new requests wait there for their handler "
                                       "(the TTFT hop `proxy`). Past it each stream merges its tokens into fewer "
                                       "chunks (mean TPOT unchanged; first and last tokens at once). 0: no budget")
    engine_process: bool = Field(True, description="run each replica's engine in its own child process (as vLLM "
                                 "v1's engine core): the replica's event loop and Ray's threads then never hold "
                                 "the GIL the engine's steps need (false: the engine runs as a thread of the "
                                 "replica)")
    loop_priority: Literal["engine", "ray"] = Field(
        "engine", description="the nice value of each LLM replica's event loop thread (it admits the requests, "
        "delivers the tokens and answers /health) where the engine's own thread undid Ray's nice 15 (an engine "
        "sharing the node's cores): engine: the engine thread's (0); ray: Ray's 15, under which a burst's "
        "admissions held /health for longer on a small box")
    log_prompts: bool = Field(False, description="log prompt text (off: only lengths and ids are logged)")
    disable_log_stats: bool = Field(False, description="vLLM's: no periodic stats line in the LLM replicas' logs "
                                    "(by default each logs, every 10 s while it serves, its prompt and generation "
                                    "throughput, running and waiting requests, KV cache usage and prefix cache hit "
                                    "rate, as vLLM's engine does)")
    access_log: bool = Field(False, description="Ray Serve's access log: a line per request in the replicas' logs "
                             "(and, through Ray's log monitor, on the driver's console). Off by default, as vLLM "
                             "logs requests only when asked: every line is work for the replica, the log monitor "
                             "and the GCS on the cores the engine steps on. Serve's request metrics stay on")

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            from deployments.llm_config import vllm_arguments  # (vLLM's names and values, as an LLMConfig's)

            data = vllm_arguments(data)
            known = set(cls.model_fields)
            if bad := _unknown_names(data, known):
                raise ValueError(f"unknown argument(s): {bad}; valid: {', '.join(sorted(known))}")
        return data

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, v: Any) -> Any:
        """vLLM's list (`--allowed-origins '["https://a.example"]'`, or a YAML list) as the comma-separated text."""
        if isinstance(v, str) and v.strip().startswith("["):
            import json

            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"allowed_origins: not a JSON list ({e})") from None
        if isinstance(v, (list, tuple)):
            if not all(isinstance(o, str) for o in v):
                raise ValueError("allowed_origins: a list of origins (strings)")
            return ",".join(v)
        return v

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) or (isinstance(v, str) and v.strip().startswith("[")):
            raise ValueError("served_model_name: one name here (vLLM's list of several names is not taken: a "
                             "request may name the model's folder too)")
        return v

    @field_validator("autoscaling_config", "runtime_env", mode="before")
    @classmethod
    def _json_text(cls, v: Any, info: Any) -> Any:
        """`serve run ... autoscaling_config='{"min_replicas": 1, "max_replicas": 4}'`: the command line's JSON."""
        if isinstance(v, str):
            import json

            try:
                return json.loads(v)
            except ValueError as e:
                raise ValueError(f"{info.field_name}: not a JSON object ({e})") from None
        return v

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator(cls, v: str | None) -> str | None:
        """An NVIDIA accelerator as Ray names it (A10 is Ray's A10G, as Ray Serve LLM reads it): a replica that asks
        for another would wait for a node that Kairos's engine cannot run on, or that Ray never names."""
        if v is None:
            return None
        import ray.util.accelerators.accelerators as ray_accelerators

        v = "A10G" if v == "A10" else v
        known = sorted({getattr(ray_accelerators, n) for n in dir(ray_accelerators) if n.startswith("NVIDIA_")})
        if v not in known:
            raise ValueError(f"accelerator_type {v!r}: not an NVIDIA GPU as Ray names them ({', '.join(known)})")
        return v

    @field_validator("max_queued_requests")
    @classmethod
    def _queued(cls, v: int) -> int:
        if v == 0:  # (Serve's DeploymentConfig refuses it, but only once the app deploys)
            raise ValueError("max_queued_requests must be -1 (no limit) or a positive integer, as Serve takes it")
        return v

    @model_validator(mode="after")
    def _validate_nested(self) -> "ServeArgs":
        if self.allow_credentials and "*" in (o.strip() for o in self.allowed_origins.split(",")):
            # (Starlette answers any page's origin with credentials allowed: any site a signed-in browser visits
            # could call the API as that user, where a proxy before it signs in by cookie)
            raise ValueError("allow_credentials needs the origins listed in allowed_origins, not '*' (browsers "
                             "refuse credentials with a wildcard origin; reflecting any origin would let every site "
                             "call the API with a user's cookies)")
        if self.autoscaling_config is not None:
            if self.num_replicas is not None:
                raise ValueError("give num_replicas or autoscaling_config, not both")
            self.autoscaling()  # Serve's checks, and Kairos's, at parse time
        if str(getattr(self, "device", "auto")).strip().lower() == "cpu" and (self.num_gpus or 0) > 0:
            # (the replica would wait for a GPU it never uses, where none is free: an app that never starts)
            raise ValueError(f"num_gpus {self.num_gpus} with device cpu: a replica on the CPU takes no GPU (give "
                             "num_gpus 0, or device auto or cuda)")
        self.engine_config()  # surfaces EngineConfig/SchedulerConfig validation errors at parse time
        # a checkpoint here the engine cannot run (or not at the context asked for): at once
        check_local_model(str(getattr(self, "model", "")), getattr(self, "max_model_len", None))
        return self

    def autoscaling(self) -> dict[str, Any] | None:
        """The LLM replicas' autoscaling config as Serve takes it (None: a fixed num_replicas): Serve's
        AutoscalingConfig checks it; `target_ongoing_requests` left out is a replica's `max_num_seqs`. ValueError
        for a scale to zero in the direct topology (with no LLM replica nothing would answer HTTP)."""
        if self.autoscaling_config is None:
            return None
        from ray.serve.config import AutoscalingConfig

        from deployments.autoscaling import POLICY_PATH

        cfg = dict(self.autoscaling_config)
        cfg.setdefault("target_ongoing_requests", self.replica_scheduler().max_num_seqs)
        cfg.setdefault("policy", {"policy_function": POLICY_PATH})  # (on what the SLOs turn away too)
        if bad := _unknown_names(cfg, set(AutoscalingConfig.model_fields)):  # (Serve's drops them: a typo'd bound
            raise ValueError(f"autoscaling_config: unknown field(s) {bad}")  # was no bound)
        try:
            checked = AutoscalingConfig(**cfg)
        except Exception as e:  # noqa: BLE001 - Serve's validation error, as a ValueError naming the field
            raise ValueError(f"autoscaling_config: {e}") from None
        if checked.min_replicas == 0 and self.topology == "direct":
            raise ValueError("autoscaling_config: min_replicas 0 needs the routed topology (topology=direct: the LLM "
                             "replicas answer HTTP themselves, and with none running nothing would; the Ingress of "
                             "the routed one holds a request while a replica starts)")
        return cfg

    @property
    def scales_to_zero(self) -> bool:
        """Whether the LLM replicas autoscale down to none (`autoscaling_config` with min_replicas 0)."""
        return self.autoscaling_config is not None and int(self.autoscaling_config.get("min_replicas", 1)) == 0

    @property
    def unready_wait(self) -> float:
        """`unready_wait_s`, or its default for this app."""
        if self.unready_wait_s is not None:
            return self.unready_wait_s
        return COLD_START_WAIT_S if self.scales_to_zero else 30.0

    @property
    def fewest_replicas(self) -> int:
        """The LLM replicas the app runs at least while it serves: `min_replicas` where it autoscales (1 where that
        is 0: a request starts one), else its `num_replicas`."""
        if self.autoscaling_config is not None:
            return max(1, int(self.autoscaling_config.get("min_replicas", 1)))
        return self.placement()[1]

    def resolved(self) -> "ServeArgs":
        """These arguments with what was left to the machine decided (`placement`), and `max_ongoing_requests`,
        where not given, what a replica's engine holds (running and waiting) and at least 256. The app is built
        from this, once (`build_app`), so that every replica gets the same numbers."""
        if self.num_gpus is not None and self.num_replicas is not None and self.max_ongoing_requests is not None:
            return self
        num_gpus, num_replicas = self.placement()
        a = self.model_copy(update={"num_gpus": num_gpus, "num_replicas": num_replicas})
        if a.max_ongoing_requests is None:
            sched = a.replica_scheduler()
            a = a.model_copy(update={"max_ongoing_requests": max(256, sched.max_num_seqs + sched.max_waiting)})
        return a

    def placement(self) -> tuple[float, int]:
        """(num_gpus, num_replicas), each as given or else: one replica per GPU of those there are
        (`gpus_for_app`) where the engine may take one (`device` auto or cuda), and where `num_replicas` is given,
        a GPU each if there are that many; otherwise one replica, on the CPU. An app that autoscales (no
        num_replicas) is sized for its most replicas."""
        if self.num_gpus is not None and self.num_replicas is not None:
            return self.num_gpus, self.num_replicas
        gpus = gpus_for_app()
        device = str(getattr(self, "device", "auto"))
        num_gpus = self.num_gpus
        if num_gpus is None and self.accelerator_type and device in ("auto", "cuda"):
            num_gpus = 1.0  # a replica that names its accelerator takes one, however many there are now
        if num_gpus is None:
            enough = gpus >= 1 and (self.num_replicas is None or self.num_replicas <= gpus)
            num_gpus = 1.0 if enough and device in ("auto", "cuda") else 0.0
        if self.autoscaling_config is not None:
            return num_gpus, int(self.autoscaling_config.get("max_replicas", 1))
        num_replicas = self.num_replicas
        if num_replicas is None:  # (the epsilon: 1.0 / 0.1 is 9.999...)
            num_replicas = max(1, min(1024, math.floor(gpus / num_gpus + 1e-9))) if 0 < num_gpus <= gpus else 1
        return num_gpus, num_replicas

    @property
    def direct(self) -> bool:
        """Whether the LLM replicas serve HTTP themselves (`topology`)."""
        if self.topology == "auto":  # (an app that scales to zero needs a front that stays up)
            return self.placement()[1] == 1 and self.ingress_num_replicas == 1 and not self.scales_to_zero
        return self.topology == "direct"

    def engine_config(self) -> EngineConfig:
        """The nested engine config; only explicitly given knobs are passed, so the configs' defaults apply."""
        given = self.model_fields_set
        eng = {k: getattr(self, k) for k in _ENGINE_FIELDS if k in given}
        num_gpus = self.placement()[0]
        if num_gpus == 0 and eng.get("device", "auto") == "auto":
            eng["device"] = "cpu"  # Ray leaves a GPU-less actor's CUDA visible: auto would take a GPU it was not given
        elif 0 < num_gpus < 1 and "gpu_memory_utilization" not in given:
            # replicas sharing a GPU: each takes its fraction of what one replica per GPU would
            eng["gpu_memory_utilization"] = EngineConfig.model_fields["gpu_memory_utilization"].default * num_gpus
        sched = {k: getattr(self, k) for k in _SCHED_FIELDS if k in given}
        if self.allow_runtime_lora_updating:
            eng["enable_lora"] = True  # (the replicas' decoders must serve adapters from the start)
        eng.setdefault("max_tokens_over_context", "reject")  # an OpenAI server answers 400, as vLLM's does
        return EngineConfig(**eng, scheduler=SchedulerConfig(**sched))

    def replica_scheduler(self) -> SchedulerConfig:
        """The scheduler config each LLM replica's engine will run: the knobs given, and the defaults of the device
        the replicas get (`engine.config.for_device`): the engine config says cpu for a replica given no GPU, and
        auto or cuda for one that will run on a GPU."""
        cfg = self.engine_config()
        return for_device(cfg, "cpu" if cfg.device == "cpu" else "cuda").scheduler

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = str(getattr(self, "model", "kairos"))
        return os.path.basename(model.rstrip("/")) or model


def gpus_for_app() -> float:
    """The GPUs the app's replicas may take: the Ray cluster's where this process is connected to one (`serve
    deploy` builds the app in a task on the cluster), else those Ray finds on this machine, as a local cluster that
    `serve run` starts gets them (NVIDIA's, within CUDA_VISIBLE_DEVICES; none where the installed torch is a CPU
    build, which `make serve` installs unless a CUDA torch is there first). `serve run --address` to another
    cluster builds the app before it connects: this machine's are counted then. 0 where it cannot tell."""
    try:
        import ray

        if ray.is_initialized():
            return float(ray.cluster_resources().get("GPU", 0.0))
    except Exception:  # noqa: BLE001 - no cluster to ask: look at this machine
        pass
    return float(_local_gpus()) if _torch_has_cuda() else 0.0


@functools.lru_cache(maxsize=1)
def _torch_has_cuda() -> bool:
    """Whether the installed torch is a build that can run on a GPU, read from its version (a CPU wheel's ends in
    +cpu) without importing it: the process that builds the app does not otherwise need torch."""
    from importlib import metadata

    try:
        return "+cpu" not in metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False


@functools.lru_cache(maxsize=1)
def _local_gpus() -> int:
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        if manager is None:
            return 0
        n = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
        return min(n, len(visible)) if visible is not None else n
    except Exception:  # noqa: BLE001 - no driver, or Ray's (pinned) private API moved: no GPU to plan for
        return 0


def load_api_keys(env_name: str | None, key_file: str | None) -> list[str]:
    """Keys are read where they are used (the ingress replica), so they never enter the Serve config. A key file
    holds one key a line; blank lines and comments (`#`, indented too) are not keys, and a byte-order mark (an
    editor's) is not part of the first. A name given empty (an unset variable in a template) is refused, as is a
    configuration that yields no key: either would serve unauthenticated."""
    for what, name in (("api_keys_env", env_name), ("api_key_file", key_file)):
        if name is not None and not name.strip():
            raise ValueError(f"{what} is empty; refusing to serve unauthenticated (leave it out for no API keys)")
    keys: list[str] = []
    if env_name:
        keys += [k.strip() for k in os.environ.get(env_name, "").split(",") if k.strip()]
    if key_file:
        with open(key_file, encoding="utf-8-sig") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.strip().startswith("#")]
    if (env_name or key_file) and not keys:
        raise ValueError(f"API-key auth is configured (api_keys_env={env_name!r}, api_key_file={key_file!r}) "
                         "but no key was found; refusing to serve unauthenticated")
    return keys


def _copied(model: type[BaseModel], names: tuple[str, ...]) -> dict[str, Any]:
    return {n: (model.model_fields[n].annotation, model.model_fields[n]) for n in names}


_clash_serve = (set(_ENGINE_FIELDS) | set(_SCHED_FIELDS)) & set(ServeArgs.model_fields)
assert not _clash_serve, f"serving and engine knobs share names {_clash_serve}"

AppArgs = create_model(  # type: ignore[call-overload]
    "AppArgs",
    __base__=ServeArgs,
    __doc__="All arguments of `build_app`: serving knobs + every EngineConfig/SchedulerConfig knob (flat).",
    **_copied(EngineConfig, _ENGINE_FIELDS),
    **_copied(SchedulerConfig, _SCHED_FIELDS),
)
