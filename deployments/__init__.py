"""Kairos on Ray Serve.

    serve run deployments:app                                   # the trained default model, one replica per GPU
                                                                # (one on the CPU where there is none)
    serve run deployments:app model=/path/to/hf dtype=float32 num_replicas=2 num_gpus=1 policy=scorpio
    serve build deployments:default_app -o serve_config.yaml    # `serve build` needs a built application

`app` is the application builder (`build_app`): Serve validates its `key=value` arguments against `AppArgs`
(see deployments/args.py for every knob), and calls it with none for a plain `serve run deployments:app`.
`default_app` is the application built with the defaults on the CPU (one replica, no GPU).

Two topologies (`topology=`): *routed*, an Ingress deployment that sends each request to one of the LLM replicas
through a Serve handle, picked by the SLO-aware router; and *direct*, LLM replicas that serve HTTP themselves,
without that hop (deployments/direct.py). The default, `auto`, is direct for one LLM replica and routed for more.

Importing this package also asks Ray Serve 2.60 for its HAProxy ingress (`haproxy_ingress`): HTTP then goes
from HAProxy straight to the replicas that serve it, not through Serve's Python proxy actor. It must be in the
environment before Ray starts, which `serve run` does after importing the app; on a cluster started with
`ray start`, cluster.yaml sets it. `RAY_SERVE_ENABLE_HA_PROXY=0` keeps Serve's Python proxy. In the same way it keeps
the replicas' request handlers on the event loop that serves their HTTP (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`),
and runs Serve's controller loop every 0.5 s instead of 0.1 s (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`, see haproxy_ingress.py).
HAProxy is spawned through a launcher that kills it with the process that spawned it and binds its stats and
Prometheus listeners to 127.0.0.1 (`KAIROS_HAPROXY_STATS_HOST` opens them). Under `serve run`, Serve's HTTP address is
`KAIROS_HTTP_HOST` (default 127.0.0.1) : `KAIROS_HTTP_PORT` (default 8000), and SIGTERM shuts down as Ctrl-C does.
"""
# NB: no `from __future__ import annotations` here: Serve inspects build_app's annotation as a class.
import logging
from typing import Any

from deployments.haproxy_ingress import hook_serve_run, prefer_haproxy_ingress, prefer_quiet_control_loop, \
    prefer_user_code_on_main_loop

prefer_haproxy_ingress()  # before Ray starts: `serve run` imports the app first
prefer_user_code_on_main_loop()
prefer_quiet_control_loop()
hook_serve_run()  # `serve run`: HTTP host/port from KAIROS_HTTP_HOST/PORT, SIGTERM stops Serve as Ctrl-C does

from ray.serve import Application  # noqa: E402

from deployments.args import COLD_START_WAIT_S, AppArgs, ServeArgs, gpus_for_app  # noqa: E402
from deployments.direct import DirectLLMServer  # noqa: E402
from deployments.ingress import Ingress, served_names  # noqa: E402
from deployments.metrics import LOG_STATS_S  # noqa: E402
from deployments.pacing import StreamPacing  # noqa: E402
from deployments.replica import LLMServer  # noqa: E402

log = logging.getLogger("ray.serve")
ROUTER_PATH = "deployments.router:SLORouter"
POW2_ROUTER_PATH = "deployments.router:Pow2Router"  # Serve's power of two choices, passing over failed replicas
FAILOVERS = 2  # the other replicas a request is sent to where the one it landed on failed before its first item
GRPC_MAX_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"  # the LLM replicas' gRPC limit on a request (bytes)


def llm_actor_options(a: ServeArgs, actor_opts: dict[str, Any]) -> dict[str, Any]:
    """The LLM replicas' actor options (routed topology). Over gRPC a request reaches its replica as one message: an
    app whose `max_body_bytes` lets in bodies that may not fit Serve's default limit raises the replicas' (a request
    pickles to about its body's size, its prompt's token ids at most doubling it)."""
    from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH as serve_max

    need = 2 * a.max_body_bytes + (1 << 20)
    if a.llm_transport != "grpc" or need <= serve_max:
        return actor_opts
    env = dict(actor_opts.get("runtime_env") or {})
    given = (env.get("env_vars") or {}).get(GRPC_MAX_ENV)
    if given is not None and str(given).isdigit():
        need = max(need, int(given))  # (a larger limit the runtime_env asks for stays)
    env["env_vars"] = {**(env.get("env_vars") or {}), GRPC_MAX_ENV: str(need)}
    return {**actor_opts, "runtime_env": env}


def build_app(args: AppArgs) -> Application:  # type: ignore[valid-type]
    """Ingress -> LLMServer x num_replicas, wired with the SLO-aware router (`topology=routed`), or LLM replicas
    that serve HTTP themselves (`topology=direct`; `auto`, the default, picks it for one replica)."""
    given: ServeArgs = args if isinstance(args, ServeArgs) else AppArgs.model_validate(args or {})
    a = given.resolved()
    llm, settings = model_parts(given, a)
    return llm if a.direct else _ingress(a).bind(llm, settings)  # (direct: the replicas are the app)


def _ingress(a: ServeArgs, cls: Any = None) -> Any:
    """The app's Ingress deployment (`cls`: Ingress, or MultiModelIngress), as `a` sizes it."""
    return (cls or Ingress).options(num_replicas=a.ingress_num_replicas, logging_config={"enable_access_log":
                                    a.access_log}, max_ongoing_requests=a.ingress_max_ongoing_requests,
                                    ray_actor_options={"num_cpus": 0})


def model_parts(given: ServeArgs, a: ServeArgs, deployment_name: str = "LLMServer", chunk_share: float = 1.0) -> Any:
    """One model's LLM deployment, as `a` (`given`, resolved) says: the bound LLM replicas (`deployment_name`; with
    the direct topology, replicas that serve HTTP themselves) and the settings of their front. `chunk_share`: the
    share of the Ingress's chunk budget (`stream_max_chunks_s`) its replicas split (an app of several models: the
    model's share of the replicas)."""
    if given.num_gpus is None and (gpus := gpus_for_app()) > 0:
        if a.num_gpus:
            log.info("kairos: %d LLM replica(s) of %g GPU each, on the %g GPU(s) Ray has%s (num_gpus / num_replicas "
                     "choose otherwise)", a.num_replicas, a.num_gpus, gpus,
                     ", each serving HTTP itself" if a.direct else ", routed by SLO slack")
        else:
            log.info("kairos: %d LLM replica(s) on the CPU: Ray has %g GPU(s), fewer than num_replicas or device "
                     "says so (num_gpus=%g would share them)", a.num_replicas, gpus, gpus / a.num_replicas)
    actor_opts: dict[str, Any] = {"num_cpus": a.num_cpus, "num_gpus": a.num_gpus}
    if a.accelerator_type:
        actor_opts["accelerator_type"] = a.accelerator_type
    if a.runtime_env:
        actor_opts["runtime_env"] = dict(a.runtime_env)
    pacing = StreamPacing.of_app(a.stream_interval_ms, a.stream_max_chunks_s * chunk_share, a.num_replicas,
                                 a.ingress_num_replicas, routed=not a.direct, direct_max_chunks_s=a.direct_max_chunks_s,
                                 autoscaled=a.autoscaling_config is not None)
    replica_args = (a.metrics_interval_s, a.log_prompts, a.num_replicas if a.num_cpus == 0 else None, pacing,
                    a.engine_process, a.loop_priority, a.model_name, 0.0 if a.disable_log_stats else LOG_STATS_S)
    settings = front_settings(a)
    # without the knobs left to their defaults: the engine fills those in for its device (`for_device`)
    engine_config = a.engine_config().model_dump(mode="json", exclude_unset=True)
    log_config = {"enable_access_log": a.access_log}
    # the LLM replicas' count: fixed, or Serve's autoscaling between its bounds (the app sized for the most)
    scaling = a.autoscaling()
    replicas: dict[str, Any] = {"autoscaling_config": scaling} if scaling is not None else \
        {"num_replicas": a.num_replicas}
    # a replica Serve stops finishes its requests first, within this (an autoscaled app stops them as load falls)
    replicas["graceful_shutdown_timeout_s"] = a.graceful_shutdown_timeout_s if a.graceful_shutdown_timeout_s is not None \
        else (600.0 if scaling is not None else 20.0)
    if a.direct:
        return DirectLLMServer.options(
            **replicas,
            logging_config=log_config,
            ray_actor_options=actor_opts,
            max_ongoing_requests=a.ingress_max_ongoing_requests,  # the replica caps its engine's share itself
            health_check_period_s=a.health_check_period_s,
            health_check_timeout_s=a.health_check_timeout_s,
        ).bind(engine_config, settings, a.max_ongoing_requests, a.max_queued_requests, *replica_args), settings
    router = {
        "request_router_class": ROUTER_PATH if a.router == "slo" else POW2_ROUTER_PATH,
        "request_routing_stats_period_s": a.routing_stats_period_s,
    }
    llm = LLMServer.options(
        name=deployment_name,
        **replicas,
        logging_config=log_config,
        ray_actor_options=llm_actor_options(a, actor_opts),
        max_ongoing_requests=a.max_ongoing_requests,
        max_queued_requests=a.max_queued_requests,
        health_check_period_s=a.health_check_period_s,
        health_check_timeout_s=a.health_check_timeout_s,
        request_router_config=router,
    ).bind(engine_config, *replica_args)
    return llm, settings


def front_settings(a: ServeArgs) -> dict[str, Any]:
    """What an app's front (its Ingress, or a replica serving HTTP itself) needs to know of the model it serves;
    ValueError for LoRA settings it could not serve."""
    settings = {
        "model_name": a.model_name, "max_body_bytes": a.max_body_bytes, "retry_after_s": a.retry_after_s,
        "log_prompts": a.log_prompts, "api_keys_env": a.api_keys_env, "api_key_file": a.api_key_file,
        "reroutes": a.reroute_rejected if a.router == "slo" and a.num_replicas > 1 and not a.direct else 0,
        # a replica's `slo_unattainable` is checked with another replica before the 400 (Ray's pow2 router cannot
        # avoid one; direct: no Ingress)
        "second_opinion": a.router == "slo" and not a.direct,
        # a request whose replica failed before its first token goes to another one (routed: the ingress's handle)
        "failovers": 0 if a.direct else FAILOVERS,
        "unready_wait_s": a.unready_wait,
        "scale_to_zero": a.scales_to_zero,  # (routed: the Ingress holds a request while an LLM replica starts)
        # the wait where the replicas say they scale to zero though the arguments did not (a Serve config's
        # `deployments:`): a cold start's, unless unready_wait_s was given
        "cold_start_wait_s": a.unready_wait_s if a.unready_wait_s is not None else COLD_START_WAIT_S,
        "cors": {"origins": [o.strip() for o in a.allowed_origins.split(",") if o.strip()],
                 "credentials": a.allow_credentials},
        "llm_transport": a.llm_transport,
        "tool_call_parser": a.tool_call_parser,
        "reasoning_parser": a.reasoning_parser,
        "trust_request_chat_template": a.trust_request_chat_template,
        "prompt_tokens_details": a.enable_prompt_tokens_details,
        # the LoRA adapters' names a request's `model` may give, and the folder of those loaded on demand
        "lora_modules": a.engine_config().lora_paths(),
        "dynamic_lora_loading_path": a.engine_config().dynamic_lora_loading_path,
        "allow_runtime_lora_updating": a.allow_runtime_lora_updating,  # /v1/load_lora_adapter and its unload
        # a batched completion's prompts in flight at once: what the replicas that serve it run at once
        # (an autoscaled app: what its fewest replicas run)
        "batch_concurrency": a.replica_scheduler().max_num_seqs * (1 if a.direct else a.fewest_replicas),
    }
    clash = set(settings["lora_modules"]) & set(served_names(a.model_name, str(getattr(a, "model", ""))))
    if clash:
        raise ValueError(f"lora_modules: {', '.join(sorted(clash))} is the served model's name: a request naming it "
                         "would run the model itself; name the adapter otherwise")
    fronts = a.num_replicas if a.direct else a.ingress_num_replicas
    if a.allow_runtime_lora_updating and fronts > 1:
        raise ValueError(f"allow_runtime_lora_updating: the adapters loaded at run time are listed by the app's front "
                         f"replica, and this app has {fronts} (ingress_num_replicas, or topology=direct with several "
                         "replicas): a load would reach one of them; serve it with one, or name the adapters in "
                         "lora_modules or dynamic_lora_loading_path")
    return settings


# the arguments of an app's one front (its Ingress): in an app of several models, the app's, whichever model gives them
FRONT_ARGS = ("api_keys_env", "api_key_file", "allowed_origins", "allow_credentials", "max_body_bytes",
              "ingress_num_replicas", "ingress_max_ongoing_requests", "access_log")


def _front_args(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The front's arguments (FRONT_ARGS) the models of an app of several give, which every model then takes: a
    ValueError where two give one differently (an API key set on one model only would otherwise be the app's or
    none, unseen)."""
    out: dict[str, tuple[int, Any]] = {}
    for i, raw in enumerate(models):
        for key in FRONT_ARGS:
            if key not in raw:
                continue
            value = AppArgs.model_validate({key: raw[key]}).model_dump()[key]  # (as parsed: "2" and 2 alike)
            if key in out and out[key][1] != value:
                raise ValueError(f"model {i}: {key}={raw[key]!r} where model {out[key][0]} gives {out[key][1]!r}: "
                                 "an app of several models has one front (its API keys, CORS, body limit and "
                                 "Ingress), so give it once, or alike on every model")
            out.setdefault(key, (i, value))
    return {k: v for k, (_, v) in out.items()}


def build_multi_model_app(models: list[dict[str, Any]]) -> Application:  # type: ignore[valid-type]
    """Several models in one app (Ray Serve LLM's several llm_configs): an LLM deployment per model
    (`LLMServer:<served name>`, each with its own replicas, SLO router and scheduler), behind one Ingress that sends
    each request to the model its `model` names (deployments/multi_model.py). `models`: each model's app arguments
    (`AppArgs`); the front's own (API keys, CORS, body limit, Ingress replicas: FRONT_ARGS) are the app's, given on
    any of its models and alike where given on several (`_front_args`). A model that names no replica count gets one
    (of a GPU where Ray has them): the default of a replica per GPU is one model's."""
    from deployments.multi_model import MultiModelIngress, deployment_name

    if len(models) < 2:
        raise ValueError("a multi-model app serves two models or more")
    shared_args = _front_args(models)
    parts, names, settings, gpus = [], {}, [], 0.0
    resolved = []
    for i, raw in enumerate(models):
        raw = {**raw, **shared_args}
        if raw.get("allow_runtime_lora_updating"):
            raise ValueError(f"model {i}: allow_runtime_lora_updating: the adapters loaded at run time have no model "
                             "to go to in an app of several; name them in lora_modules or dynamic_lora_loading_path")
        # (nor from VLLM_ALLOW_RUNTIME_LORA_UPDATING's default: it turned adapters on in every engine, and a model
        # that cannot serve them failed to start)
        raw["allow_runtime_lora_updating"] = False
        if "num_replicas" not in raw and "autoscaling_config" not in raw:
            raw["num_replicas"] = 1
        given = AppArgs.model_validate({**raw, "topology": "routed"})
        resolved.append((given, given.resolved()))
    # one Ingress relays every model's streams: its chunk budget is split over all the models' replicas, an
    # autoscaled model's counted at its least (at its most, 100 for Ray's `auto`, it left the others next to nothing;
    # each model's replicas split its share over those running)
    def weight(a: ServeArgs) -> int:
        scaling = a.autoscaling_config
        return a.num_replicas if scaling is None else max(1, int(scaling.get("min_replicas", 1) or 0))
    replicas = sum(weight(a) for _, a in resolved)
    for i, (given, a) in enumerate(resolved):
        own = [a.model_name, *a.engine_config().lora_paths()]  # (the names a request may give it, beside aliases)
        for name in (deployment_name(a.model_name), *own):
            if name in names:
                raise ValueError(f"model {i} ({a.model_name!r}): {name!r} names model {names[name]} of the app too")
            names[name] = i
        llm, s = model_parts(given, a, deployment_name(a.model_name), weight(a) / max(replicas, 1))
        parts.append(llm)
        if i == 0:  # (every model's front arguments alike: the app's, `_front_args`)
            front, shared = a, {k: s[k] for k in ("max_body_bytes", "api_keys_env", "api_key_file", "cors")}
        # (the app's front: one key set, one CORS policy, one body limit; the names the model is known by before its
        # replicas say them)
        settings.append({**s, **shared, "aliases": served_names(a.model_name, str(a.model))})
        gpus += a.num_gpus * a.num_replicas  # (an autoscaled model's: its most)
    if 0 < (have := gpus_for_app()) < gpus:
        log.warning("kairos: the app's models ask for %g GPU(s) in all and Ray has %g: the replicas beyond wait for "
                    "GPUs (a cluster autoscaler's nodes), and /health is 503 until every model serves; give num_gpus "
                    "(a share) or fewer replicas", gpus, have)
    return _ingress(front, MultiModelIngress).bind(parts, settings)


app = build_app  # `serve run deployments:app [key=value ...]`


def build_openai_app(builder_config: dict) -> Application:  # type: ignore[valid-type]
    """Ray Serve LLM's `build_openai_app` arguments (`llm_configs`: its LLMConfigs; deployments/llm_config.py) as
    a Kairos app (of several models: `build_multi_model_app`): a Ray Serve LLM config runs with `import_path:
    deployments:build_openai_app`, with Ray Serve LLM's defaults where it names none: one replica, and a GPU for
    each (`ray_actor_options.num_gpus` 0, or `device: cpu` among its engine_kwargs, serves on the CPU)."""
    from deployments.llm_config import translate_all

    models = [_ray_serve_llm_defaults(m) for m in translate_all(builder_config)]
    if len(models) > 1:
        return build_multi_model_app(models)
    return build_app(AppArgs.model_validate(models[0]))


def _ray_serve_llm_defaults(one: dict[str, Any]) -> dict[str, Any]:
    """A Ray Serve LLM model's arguments with its defaults where they name none: one replica (autoscaling from 1 to 1),
    not one per GPU; a prompt longer than a step's budget computed in chunks, as vLLM V1's; and a GPU a replica, as
    vLLM's placement asks for one and waits where none is free yet (a cluster that adds GPU nodes on demand shows none
    when the app is built: Kairos's own default, the CPU where no GPU is found, put every replica there)."""
    if "num_replicas" not in one and "autoscaling_config" not in one:
        one = {**one, "num_replicas": 1}
    if "chunked_prefill" not in one:  # (vLLM V1's: engine_kwargs enable_chunked_prefill false turns it off)
        one = {**one, "chunked_prefill": True}
    if "num_gpus" not in one and one.get("device", "auto") in ("auto", "cuda"):  # (as `placement` reads a device)
        one = {**one, "num_gpus": 1.0}
        if gpus_for_app() == 0:
            log.warning("kairos: model %r: a replica asks for a GPU, as Ray Serve LLM's does, and Ray shows none "
                        "now: it waits for one (a node that brings one); give deployment_config.ray_actor_options."
                        "num_gpus 0 (or engine_kwargs device cpu) to serve on the CPU", one.get("served_model_name"))
    return one


def __getattr__(name: str) -> Any:
    """`default_app` (`serve build deployments:default_app`), built when first asked for, not by every process that
    imports the package (each replica does). It is one replica on the CPU wherever it is built: the file `serve build`
    writes must describe the app that the cluster builds again from the same name (edit it for GPUs, as
    serve_config.yaml is)."""
    if name == "default_app":
        built = globals()["default_app"] = build_app(AppArgs(num_gpus=0, num_replicas=1))
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["AppArgs", "app", "build_app", "build_multi_model_app", "build_openai_app", "default_app"]
