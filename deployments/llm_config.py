"""Ray Serve LLM's application config, served by Kairos: `build_openai_app`'s arguments read as `AppArgs`.

A Ray Serve LLM config (`import_path: ray.serve.llm:build_openai_app`, `args: {llm_configs: [...]}`) runs as a Kairos
app by pointing its import path at `deployments:build_openai_app`, the rest of the file as it is:

    applications:
    - name: llm
      route_prefix: /
      import_path: deployments:build_openai_app
      args:
        llm_configs:
        - model_loading_config: {model_id: qwen, model_source: /models/Qwen2.5-7B-Instruct}
          engine_kwargs: {max_model_len: 8192, max_num_seqs: 128, enable_chunked_prefill: true}
          deployment_config: {num_replicas: 2}
          lora_config: {dynamic_lora_loading_path: /models/adapters, max_num_adapters_per_replica: 8}

Each part of an `LLMConfig` maps to what Kairos has for it (`translate`): the model's id is its served name and its
source the checkpoint; `engine_kwargs` are vLLM's engine arguments, under Kairos's names where they differ
(`VLLM_NAMES`), any Kairos argument too (`policy`, SLO knobs); `deployment_config` the replicas' count and Serve
options (autoscaling too); `lora_config` the adapters loaded on demand. What Kairos cannot do as asked (tensor
parallelism, cloud mirrors, another engine, a custom server class) is a ValueError naming it, at build time (several
`llm_configs` are one app of several models: `deployments.multi_model`); vLLM arguments that change nothing served
here (`VLLM_NO_EFFECT`) are accepted and logged.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


log = logging.getLogger("ray.serve")

# Ray Serve LLM's LoraConfig fields
_LORA_FIELDS = ("dynamic_lora_loading_path", "max_num_adapters_per_replica", "download_timeout_s",
                "max_download_tries")
# vLLM's engine arguments by Kairos's name where the two differ
VLLM_NAMES = {
    "max_num_batched_tokens": "prefill_max_tokens",
    "enable_chunked_prefill": "chunked_prefill",
    "max_cpu_loras": None,  # (no CPU tier of adapters here: the replicas keep max_loras loaded)
}
# vLLM's engine arguments that change nothing a client sees here: accepted with their value logged
VLLM_NO_EFFECT = frozenset((
    "disable_log_requests", "enable_log_requests",
    "distributed_executor_backend", "swap_space", "max_seq_len_to_capture", "disable_custom_all_reduce",
    "max_parallel_loading_workers", "download_dir", "compilation_config", "async_scheduling",
    # (Kairos's own structured outputs and reasoning reader stand for vLLM's backends; logging and loading display)
    "guided_decoding_backend", "structured_outputs_config", "enable_reasoning", "use_tqdm_on_load",
    "uvicorn_log_level", "disable_uvicorn_access_log", "max_log_len"))
# vLLM's engine arguments that must keep their default (one GPU per replica, no quantization or drafts here)
VLLM_ONE = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}
VLLM_REFUSED = frozenset(("quantization", "speculative_config", "kv_transfer_config", "cpu_offload_gb", "task",
                          "runner", "limit_mm_per_prompt", "pooler_config", "kv_events_config"))
# vLLM's engine arguments accepted at these values only (what Kairos does), with vLLM's default among them (Kairos
# attends to the whole context: a sliding-window model's context is capped at its window, vLLM's
# disable_sliding_window true; its default, false, is taken too: the loader names the cap where it binds)
VLLM_AT = {"tokenizer_mode": ("auto",), "revision": (None, "main"), "tokenizer_revision": (None, "main"),
           "disable_sliding_window": (False, True), "enable_sleep_mode": (False,), "skip_tokenizer_init": (False,),
           "code_revision": (None, "main"), "config_format": ("auto",), "calculate_kv_scales": (False,),
           "enable_prompt_embeds": (False,), "response_role": ("assistant",), "long_prefill_token_threshold": (0,)}
# an LLMConfig's fields and Serve deployment options this module reads (the rest must be absent or at their default)
_LLM_FIELDS = frozenset(("model_loading_config", "llm_engine", "engine_kwargs", "accelerator_type", "lora_config",
                         "deployment_config", "runtime_env", "log_engine_metrics", "experimental_configs",
                         "accelerator_config", "placement_group_config", "server_cls", "callback_config"))
_DEPLOYMENT = {"num_replicas": "num_replicas", "max_ongoing_requests": "max_ongoing_requests",
               "max_queued_requests": "max_queued_requests", "health_check_period_s": "health_check_period_s",
               "health_check_timeout_s": "health_check_timeout_s",
               "graceful_shutdown_timeout_s": "graceful_shutdown_timeout_s"}
_DEPLOYMENT_NO_EFFECT = frozenset(("name", "graceful_shutdown_wait_loop_s", "logging_config"))


def _refuse(where: str, why: str) -> ValueError:
    return ValueError(f"Ray Serve LLM config: {where}: {why}")


def _plain(value: Any) -> Any:
    """A pydantic model (Ray Serve LLM's LLMConfig or LLMServingArgs, built in Python) as the mapping of what it was
    given; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_unset=True) if callable(dump) else value


def _llm_config(entry: Any) -> dict[str, Any]:
    """One of `llm_configs`: a mapping (or an LLMConfig), or the path of a YAML file that holds one (as Ray Serve
    LLM reads them)."""
    entry = _plain(entry)
    if isinstance(entry, (str, Path)):
        import yaml  # (Ray's dependency)

        path = Path(entry)
        if not path.is_file():
            raise _refuse("llm_configs", f"{str(entry)!r} is not a file")
        entry = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(entry, dict):
        raise _refuse("llm_configs", f"each entry must be a mapping (an LLMConfig) or a YAML file's path, got "
                      f"{type(entry).__name__}")
    return entry


def translate(builder_config: dict[str, Any]) -> dict[str, Any]:
    """`build_openai_app`'s arguments (Ray Serve LLM's `LLMServingArgs`) of one model as Kairos's flat app arguments
    (`AppArgs`' names); ValueError for what Kairos would not serve as asked (several models too: `translate_all`)."""
    models = translate_all(builder_config)
    if len(models) > 1:
        raise _refuse("llm_configs", f"{len(models)} models: build_openai_app serves them as one app of several")
    return models[0]


def translate_all(builder_config: dict[str, Any]) -> list[dict[str, Any]]:
    """`build_openai_app`'s arguments (Ray Serve LLM's `LLMServingArgs`) as each model's Kairos app arguments
    (`AppArgs`' names), the ingress deployment's options in each; ValueError for what Kairos would not serve as
    asked."""
    builder_config = _plain(builder_config)
    if not isinstance(builder_config, dict):
        raise _refuse("args", "must be a mapping with llm_configs")
    unknown = set(builder_config) - {"llm_configs", "ingress_deployment_config", "ingress_cls_config"}
    if unknown:
        raise _refuse("args", f"unknown field(s) {', '.join(sorted(map(str, unknown)))} (LLMServingArgs has "
                      "llm_configs, ingress_deployment_config and ingress_cls_config)")
    configs = builder_config.get("llm_configs")
    if not isinstance(configs, list) or not configs:
        raise _refuse("llm_configs", "must be a non-empty list of LLMConfigs")
    if builder_config.get("ingress_cls_config"):
        raise _refuse("ingress_cls_config", "Kairos's ingress is its own: no other ingress class")
    front: dict[str, Any] = {}
    ingress = _plain(builder_config.get("ingress_deployment_config")) or {}
    for key, value in ingress.items():
        if key == "num_replicas":
            front["ingress_num_replicas"] = value
        elif key == "max_ongoing_requests":
            front["ingress_max_ongoing_requests"] = value
        elif key not in _DEPLOYMENT_NO_EFFECT:
            raise _refuse(f"ingress_deployment_config.{key}", "not an option of Kairos's ingress (num_replicas and "
                          "max_ongoing_requests are)")
    out = [{**_from_llm_config(_llm_config(cfg), i), **front} for i, cfg in enumerate(configs)]
    names = [m["served_model_name"] for m in out]
    if len(set(names)) < len(names):
        raise _refuse("llm_configs", f"model_ids {names}: each model needs a name of its own")
    return out


def _from_llm_config(cfg: dict[str, Any], i: int = 0) -> dict[str, Any]:
    unknown = set(cfg) - _LLM_FIELDS
    if unknown:
        raise _refuse(f"llm_configs[{i}]", f"unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    out: dict[str, Any] = {}
    loading = cfg.get("model_loading_config")
    if not isinstance(loading, dict) or not isinstance(loading.get("model_id"), str) or not loading["model_id"]:
        raise _refuse("model_loading_config", "must give model_id (the name clients ask for)")
    if unknown := set(loading) - {"model_id", "model_source", "tokenizer_source"}:  # (as Ray Serve LLM's)
        raise _refuse("model_loading_config", f"unknown field(s) {', '.join(sorted(map(str, unknown)))} (it has "
                      "model_id, model_source and tokenizer_source)")
    source = loading.get("model_source") or loading["model_id"]
    for name, value in (("model_source", source), ("tokenizer_source", loading.get("tokenizer_source"))):
        if not (value is None or isinstance(value, str)) or "://" in str(value or ""):  # (Ray reads s3://... so)
            raise _refuse(f"model_loading_config.{name}", "a cloud mirror (bucket_uri, s3://, gs://, ...) is not "
                          "read here: copy the checkpoint to a folder the replicas' hosts share and give its path")
    out["model"], out["served_model_name"] = source, loading["model_id"]
    if loading.get("tokenizer_source"):
        out["tokenizer"] = loading["tokenizer_source"]
    engine = cfg.get("llm_engine", "vLLM")
    if str(engine).lower() != "vllm":
        raise _refuse("llm_engine", f"{engine!r}: Kairos runs its own engine in vLLM's place (vLLM's arguments "
                      "are read)")
    for name in ("accelerator_config", "server_cls"):
        if cfg.get(name):
            raise _refuse(name, "not read here: a Kairos replica is one engine on one GPU (or the CPU), its server "
                          "Kairos's own")
    out.update(_placement(cfg.get("placement_group_config")))
    callback = cfg.get("callback_config")
    if callback and any(v not in (None, {}, [], False) for v in (callback.values() if isinstance(callback, dict)
                                                                 else [callback])):
        raise _refuse("callback_config", "model initialization callbacks are not run here")
    if cfg.get("accelerator_type"):
        out["accelerator_type"] = cfg["accelerator_type"]
    if cfg.get("runtime_env"):
        out["runtime_env"] = cfg["runtime_env"]
    experimental = cfg.get("experimental_configs") or {}
    if not isinstance(experimental, dict):
        raise _refuse("experimental_configs", "must be a mapping")
    for key, value in experimental.items():
        if key == "stream_batching_interval_ms":
            out["stream_interval_ms"] = value
        elif key == "num_ingress_replicas":
            out["ingress_num_replicas"] = value
        else:
            raise _refuse(f"experimental_configs.{key}", "not read here (stream_batching_interval_ms and "
                          "num_ingress_replicas are)")
    kwargs = cfg.get("engine_kwargs") or {}
    if isinstance(kwargs, dict) and kwargs.get("hf_token"):  # (vLLM's: the hub's token, for a gated model's files)
        kwargs = {k: v for k, v in kwargs.items() if k != "hf_token"}
        env = dict(out.get("runtime_env") or {})
        env["env_vars"] = {**(env.get("env_vars") or {}), "HF_TOKEN": str(cfg["engine_kwargs"]["hf_token"])}
        out["runtime_env"] = env
    out.update(_engine_kwargs(kwargs))
    deployment = _deployment(cfg.get("deployment_config") or {})
    for where, env in (("runtime_env", out.get("runtime_env")),
                       ("deployment_config.ray_actor_options.runtime_env", deployment.get("runtime_env"))):
        if env is not None and not isinstance(env, dict):
            raise _refuse(where, "must be a mapping (Ray's runtime_env)")
    if "runtime_env" in deployment and "runtime_env" in out:  # (the LLMConfig's win, key by key; env_vars merged)
        dep_env, own = dict(deployment.pop("runtime_env") or {}), out["runtime_env"]
        env_vars = {**(dep_env.get("env_vars") or {}), **(own.get("env_vars") or {})}
        out["runtime_env"] = {**dep_env, **own, **({"env_vars": env_vars} if env_vars else {})}
    if "accelerator_type" in out:  # (the LLMConfig's own, over ray_actor_options')
        deployment.pop("accelerator_type", None)
    for name in ("num_gpus", "num_cpus"):
        if name in deployment and name in out and deployment[name] != out[name]:
            raise _refuse(f"deployment_config.ray_actor_options.{name}", f"{deployment[name]!r}, where the config "
                          f"gives {out[name]!r} too (placement_group_config or engine_kwargs): give one")
    out.update(deployment)
    lora = cfg.get("lora_config")
    if lora:
        if not isinstance(lora, dict):
            raise _refuse("lora_config", "must be a mapping")
        if unknown := set(lora) - set(_LORA_FIELDS):  # (as Ray Serve LLM's)
            raise _refuse("lora_config", f"unknown field(s) {', '.join(sorted(map(str, unknown)))} (it has "
                          f"{', '.join(_LORA_FIELDS)})")
        for name in ("download_timeout_s", "max_download_tries"):  # (adapters are read from a path: no download)
            if lora.get(name) is not None:
                log.info("kairos: lora_config.%s=%r changes nothing here; ignored", name, lora[name])
        if lora.get("dynamic_lora_loading_path"):
            out["dynamic_lora_loading_path"] = lora["dynamic_lora_loading_path"]
        if lora.get("max_num_adapters_per_replica") is not None:
            per = lora["max_num_adapters_per_replica"]
            if out.get("max_loras") not in (None, per):
                raise _refuse("lora_config.max_num_adapters_per_replica", f"{per!r}, where engine_kwargs.max_loras "
                              f"is {out['max_loras']!r}: give one")
            out["max_loras"] = per
        out["enable_lora"] = True
    return out


VLLM_ARGUMENTS = frozenset((*VLLM_NAMES, *VLLM_NO_EFFECT, *VLLM_ONE, *VLLM_REFUSED, *VLLM_AT,
                            "enable_auto_tool_choice"))


def vllm_arguments(args: dict[str, Any]) -> dict[str, Any]:
    """App arguments (`serve run deployments:app key=value`) with vLLM's engine arguments among them read as in a
    Ray Serve LLM config's engine_kwargs (its names, `max-model-len` for `max_model_len`); the rest as they are."""
    args = _underscored(args)
    vllm = {k: _scalar(v) if k not in VLLM_NAMES else v for k, v in args.items() if k in VLLM_ARGUMENTS}
    if not vllm:
        return args
    try:
        taken = _engine_kwargs(vllm)
    except ValueError as e:  # (named as the command line names it)
        raise ValueError(str(e).replace("Ray Serve LLM config: engine_kwargs.", "", 1)) from None
    if "chunked_prefill" in args and "enable_chunked_prefill" not in vllm:  # (Kairos's own name, given: it stands)
        taken.pop("chunked_prefill", None)
    return {**{k: v for k, v in args.items() if k not in vllm}, **taken}


def _underscored(args: dict[str, Any]) -> dict[str, Any]:
    """Arguments named as vLLM's command line spells them (`max-model-len`) under their names (`max_model_len`)."""
    return {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in args.items()}


def _scalar(value: Any) -> Any:
    """A command line's text as the JSON scalar it spells ("1", "false", "null"), else as it is ("auto")."""
    if isinstance(value, str):
        import json

        try:
            got = json.loads(value)
        except ValueError:
            return value
        return got if got is None or isinstance(got, (bool, int, float)) else value
    return value


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's engine arguments under Kairos's names; a Kairos argument passes as it is (AppArgs checks names and
    values, and suggests a near name for an unknown one)."""
    if not isinstance(kwargs, dict):
        raise _refuse("engine_kwargs", "must be a mapping of vLLM engine arguments")
    kwargs = _underscored(kwargs)
    out: dict[str, Any] = {}
    auto_tools_off = False
    for key, value in kwargs.items():
        if key in VLLM_ONE:
            if value not in (None, VLLM_ONE[key]):
                raise _refuse(f"engine_kwargs.{key}", f"{value!r}: a Kairos replica runs its model on one GPU "
                              "(give num_replicas for more)")
        elif key in VLLM_REFUSED:
            if value not in (None, {}, False, "auto", "generate"):
                raise _refuse(f"engine_kwargs.{key}", f"{value!r}: not supported by Kairos's engine")
        elif key in VLLM_AT:
            if value not in VLLM_AT[key]:
                raise _refuse(f"engine_kwargs.{key}", f"{value!r}: Kairos runs with "
                              f"{' or '.join(map(repr, VLLM_AT[key]))}")
            log.info("kairos: engine_kwargs.%s=%r accepted (Kairos's way)", key, value)
        elif key in VLLM_NO_EFFECT:
            log.info("kairos: engine_kwargs.%s=%r changes nothing here; ignored", key, value)
        elif key in VLLM_NAMES:
            if VLLM_NAMES[key] is not None:
                out[VLLM_NAMES[key]] = value
        elif key == "model" or key == "served_model_name":
            raise _refuse(f"engine_kwargs.{key}", "give it in model_loading_config (model_source, model_id)")
        elif key == "seed" and value is None:  # (vLLM's: none)
            continue
        elif key == "enable_auto_tool_choice":  # (true: Kairos reads a model's own tool calls wherever it can)
            if value is False:  # vLLM's: tool_choice auto is a 400 (Kairos's tool_call_parser none), whatever parser
                auto_tools_off = True
            else:
                log.info("kairos: engine_kwargs.%s=%r changes nothing here; ignored", key, value)
        else:
            out[key] = value
    if auto_tools_off:
        out["tool_call_parser"] = "none"
    if "max_num_batched_tokens" in kwargs and "enable_chunked_prefill" not in kwargs:
        # (vLLM's: a step's token cap, a longer prompt computed in chunks within it; Kairos's prefill_max_tokens alone
        # is a round's budget that one longer prompt exceeds)
        out.setdefault("chunked_prefill", True)
    return out


def _placement(pg: Any) -> dict[str, Any]:
    """A placement group config of one bundle (`bundles` of one, or `bundle_per_worker`: a replica is one worker
    here) as a replica's GPUs and CPUs; anything else refused: a Kairos replica is one engine on one GPU, or a
    share of one, or the CPU."""
    if not pg:
        return {}
    if not isinstance(pg, dict):
        raise _refuse("placement_group_config", "must be a mapping (bundles, strategy)")
    bundles = pg.get("bundles")
    one = pg.get("bundle_per_worker") if bundles is None else (bundles[0] if isinstance(bundles, list)
                                                                and len(bundles) == 1 else None)
    rest = set(pg) - {"bundles", "bundle_per_worker", "strategy"}
    if not isinstance(one, dict) or rest or (bundles is not None and "bundle_per_worker" in pg) \
            or set(one) - {"GPU", "CPU"} or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                                                or (k == "GPU" and v > 1) for k, v in one.items()):
        raise _refuse("placement_group_config", "one bundle of GPU (at most 1) and CPU is read here: a Kairos "
                      "replica is one engine on one GPU, a share of one, or the CPU")
    # (a bundle of no GPU is a replica on the CPU, as Ray Serve LLM reads one)
    return {"num_gpus": float(one.get("GPU", 0)), **({"num_cpus": float(one["CPU"])} if "CPU" in one else {})}


def _deployment(dep: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(dep, dict):
        raise _refuse("deployment_config", "must be a mapping of Serve deployment options")
    out: dict[str, Any] = {}
    auto = dep.get("num_replicas") == "auto"
    for key, value in dep.items():
        if key == "num_replicas" and auto:  # Serve's: autoscaling from 1 to 100 replicas (its target left to
            # Kairos's: max_num_seqs), under what autoscaling_config gives, whichever comes first
            given = dep.get("autoscaling_config")
            out["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 100,
                                         **(given if isinstance(given, dict) else {})}
        elif key in _DEPLOYMENT:
            out[_DEPLOYMENT[key]] = value
        elif key == "autoscaling_config":  # (Serve's, checked with Kairos's default target by AppArgs)
            if not auto or (value is not None and not isinstance(value, dict)):  # (auto's merges a mapping or none)
                out["autoscaling_config"] = value
        elif key == "ray_actor_options":
            opts = dict(value or {})
            for name in ("num_gpus", "num_cpus", "accelerator_type", "runtime_env"):  # (Kairos's names too)
                if name in opts:
                    out[name] = opts.pop(name)
            if opts:
                raise _refuse("deployment_config.ray_actor_options", f"{', '.join(sorted(opts))}: not read here "
                              "(num_gpus, num_cpus, accelerator_type and runtime_env are)")
        elif key == "user_config":
            if value:
                raise _refuse("deployment_config.user_config", "a Kairos replica's user_config holds its "
                              "scheduler knobs (policy, ...): give them in engine_kwargs here")
        elif key == "request_router_config":
            raise _refuse("deployment_config.request_router_config", "Kairos routes by SLO slack (router=slo) or "
                          "power of two choices (router=pow2): give router in engine_kwargs")
        elif key not in _DEPLOYMENT_NO_EFFECT:
            raise _refuse(f"deployment_config.{key}", "not a Serve deployment option Kairos reads")
    return out
