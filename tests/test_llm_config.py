"""A Ray Serve LLM config (`build_openai_app`'s arguments) read as Kairos's app arguments: what maps, what is refused.
Over HTTP, tests/serve/test_overload.py's app is built from such a config."""
import pytest

from deployments.args import COLD_START_WAIT_S
from deployments.llm_config import translate

LLM = {
    "model_loading_config": {"model_id": "qwen", "model_source": "kairos-tiny"},
    "accelerator_type": "A10G",
    "engine_kwargs": {"max_model_len": 512, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
                      "enable_chunked_prefill": True, "tensor_parallel_size": 1, "enforce_eager": True,
                      "enable_auto_tool_choice": True, "tool_call_parser": "hermes", "dtype": "float32",
                      "policy": "scorpio"},  # (a Kairos argument passes as it is)
    "deployment_config": {"num_replicas": 2, "max_ongoing_requests": 64,
                          "ray_actor_options": {"num_gpus": 0, "runtime_env": {"env_vars": {"A": "1"}}}},
    "lora_config": {"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 4},
    "experimental_configs": {"stream_batching_interval_ms": 50},
    "log_engine_metrics": True,
}


def test_a_ray_serve_llm_config_maps_to_kairos_arguments():
    assert translate({"llm_configs": [LLM], "ingress_deployment_config": {"num_replicas": 2}}) == {
        "model": "kairos-tiny", "served_model_name": "qwen", "accelerator_type": "A10G",
        "max_model_len": 512, "max_num_seqs": 32, "prefill_max_tokens": 2048, "chunked_prefill": True,
        "enforce_eager": True, "tool_call_parser": "hermes", "dtype": "float32", "policy": "scorpio",
        "num_replicas": 2, "max_ongoing_requests": 64, "num_gpus": 0, "runtime_env": {"env_vars": {"A": "1"}},
        "dynamic_lora_loading_path": "/adapters", "max_loras": 4, "enable_lora": True, "stream_interval_ms": 50,
        "ingress_num_replicas": 2}
    # model_source left out: the model id is the checkpoint (a hub id, or a folder), as Ray Serve LLM reads it
    assert translate({"llm_configs": [{"model_loading_config": {"model_id": "kairos-tiny"}}]}) == {
        "model": "kairos-tiny", "served_model_name": "kairos-tiny"}
    # Serve's autoscaling, as given (AppArgs checks it, with a replica's seats as the default target)
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}
    one = {"model_loading_config": {"model_id": "m"}, "deployment_config": {"autoscaling_config": scaling}}
    assert translate({"llm_configs": [one]})["autoscaling_config"] == scaling


def test_vllm_arguments_at_what_kairos_does_are_accepted_and_others_refused():
    base = {"model_loading_config": {"model_id": "m"}}
    ok = {"tokenizer_mode": "auto", "revision": "main", "disable_sliding_window": False, "enable_sleep_mode": False}
    assert translate({"llm_configs": [{**base, "engine_kwargs": ok}]}) == {"model": "m", "served_model_name": "m"}
    # vLLM's disable_sliding_window true is what Kairos does with a sliding-window model (full attention, the
    # context capped at the window); false, vLLM's default, is taken too (the cap, which a longer max_model_len names)
    one = {**base, "engine_kwargs": {"disable_sliding_window": True, "dtype": "half"}}
    assert translate({"llm_configs": [one]}) == {"model": "m", "served_model_name": "m", "dtype": "half"}
    with pytest.raises(ValueError, match="enable_sleep_mode: True"):
        translate({"llm_configs": [{**base, "engine_kwargs": {"enable_sleep_mode": True}}]})
    # max_logprobs: the most a request may ask for, kept as given (it was refused but at vLLM's default)
    for cap in (5, 100, -1):
        assert translate({"llm_configs": [{**base, "engine_kwargs": {"max_logprobs": cap}}]})["max_logprobs"] == cap
    # disable_log_stats: the replicas' periodic stats line off, as vLLM's (it was accepted and changed nothing)
    assert translate({"llm_configs": [{**base, "engine_kwargs": {"disable_log_stats": True}}]})["disable_log_stats"]
    # hf_token: the hub's token for a gated model's files, in the replicas' environment (it was dropped)
    got = translate({"llm_configs": [{**base, "runtime_env": {"env_vars": {"A": "1"}},
                                      "engine_kwargs": {"hf_token": "hf_xxx"}}]})
    assert got["runtime_env"] == {"env_vars": {"A": "1", "HF_TOKEN": "hf_xxx"}} and "hf_token" not in got


def test_pydantic_configs_built_in_python_are_read_as_their_mappings():
    from pydantic import BaseModel

    class Loading(BaseModel):  # (Ray's LLMConfig is a pydantic model of this kind)
        model_id: str
        model_source: str | None = None

    class Config(BaseModel):
        model_loading_config: Loading
        engine_kwargs: dict = {}
        callback_config: dict = {"callback_class": "x"}  # a default: not given, so not read

    cfg = Config(model_loading_config=Loading(model_id="q", model_source="kairos-tiny"),
                 engine_kwargs={"max_num_seqs": 8})
    assert translate({"llm_configs": [cfg]}) == {"model": "kairos-tiny", "served_model_name": "q", "max_num_seqs": 8}


def test_an_accelerator_type_takes_a_gpu_and_is_named_as_ray_names_it():
    from deployments import AppArgs

    args = AppArgs.model_validate({"model": "kairos-tiny", "num_replicas": 4, "accelerator_type": "A10"})
    assert args.accelerator_type == "A10G" and args.placement() == (1.0, 4)  # (a GPU each, whatever Ray has now)
    with pytest.raises(ValueError, match="not an NVIDIA GPU"):
        AppArgs.model_validate({"model": "kairos-tiny", "accelerator_type": "TPU-V4"})


def test_a_remote_adapter_store_is_refused_not_read_as_a_local_folder():
    from deployments import AppArgs

    with pytest.raises(ValueError, match="not from a remote store"):
        AppArgs.model_validate(translate({"llm_configs": [{"model_loading_config": {"model_id": "kairos-tiny"},
                                                            "lora_config": {"dynamic_lora_loading_path": "s3://b/l"}}]}))


def test_an_llm_config_file_is_read_as_ray_serve_llm_reads_it(tmp_path):
    import yaml

    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump({"model_loading_config": {"model_id": "q", "model_source": "kairos-tiny"},
                                    "engine_kwargs": {"max_num_seqs": 8}}))
    assert translate({"llm_configs": [str(path)]}) == {"model": "kairos-tiny", "served_model_name": "q",
                                                        "max_num_seqs": 8}
    with pytest.raises(ValueError, match="is not a file"):
        translate({"llm_configs": [str(tmp_path / "none.yaml")]})


@pytest.mark.parametrize("config, says", [
    ({"llm_configs": [LLM, {**LLM, "model_loading_config": {"model_id": "b"}}]}, "as one app of several"),
    ({"llm_configs": [LLM, LLM]}, "a name of its own"),
    ({"llm_configs": []}, "non-empty list"),
    ({"llm_configs": [{"engine_kwargs": {}}]}, "model_id"),
    ({"llm_configs": [{**LLM, "engine_kwargs": {"tensor_parallel_size": 2}}]}, "tensor_parallel_size: 2"),
    ({"llm_configs": [{**LLM, "engine_kwargs": {"quantization": "awq"}}]}, "quantization: 'awq'"),
    ({"llm_configs": [{**LLM, "model_loading_config": {"model_id": "m", "model_source": {
        "bucket_uri": "s3://b/m"}}}]}, "cloud mirror"),
    ({"llm_configs": [{**LLM, "llm_engine": "SGLang"}]}, "llm_engine"),
    ({"llm_configs": [{**LLM, "placement_group_config": {"bundles": [{"GPU": 1}] * 2}}]}, "placement_group_config"),
    ({"llm_configs": [{**LLM, "deployment_config": {"user_config": {"x": 1}}}]}, "user_config"),
    ({"llm_configs": [LLM], "ingress_cls_config": {"ingress_cls": "x:Y"}}, "ingress_cls_config"),
    ({"llm_configs": [LLM], "extra": 1}, "unknown field"),
    ({"llm_configs": [{**LLM, "surprise": 1}]}, "unknown field"),
    ({"llm_configs": [{**LLM, "model_loading_config": {"model_id": "q", "model_sorce": "/ckpt"}}]},
     "model_loading_config: unknown field"),
    ({"llm_configs": [{**LLM, "lora_config": {"dynamic_lora_path": "/a"}}]}, "lora_config: unknown field"),
    ({"llm_configs": [{**LLM, "experimental_configs": ["x"]}]}, "experimental_configs: must be a mapping"),
])
def test_what_kairos_would_not_serve_as_asked_is_refused_naming_it(config, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        translate(config)


def test_the_app_builds_from_a_ray_serve_llm_config_and_checks_what_it_maps_to():
    from ray.serve import Application

    from deployments import AppArgs, build_openai_app

    cfg = {"llm_configs": [{"model_loading_config": {"model_id": "tiny", "model_source": "kairos-tiny"},
                            "engine_kwargs": {"max_num_batched_tokens": 256, "dtype": "float32"},
                            "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_gpus": 0}}}]}
    assert isinstance(build_openai_app(cfg), Application)
    args = AppArgs.model_validate(translate(cfg))
    assert (args.served_model_name, args.prefill_max_tokens, args.num_replicas) == ("tiny", 256, 1)
    # autoscaling: Serve's between its bounds, the app sized for the most (routed beyond one replica)
    cfg["llm_configs"][0]["deployment_config"] = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                                                  "ray_actor_options": {"num_gpus": 0}}
    llm = build_openai_app(cfg)._bound_deployment.init_args[0]._bound_deployment
    scaling = llm._deployment_config.autoscaling_config
    assert llm.name == "LLMServer" and (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    assert scaling.target_ongoing_requests == AppArgs.model_validate(translate(cfg)).replica_scheduler().max_num_seqs
    # Kairos's policy (what the replicas turn away too), and a scale-down lets a replica finish its long replies
    assert scaling.policy.policy_function == "deployments.autoscaling:slo_autoscaling_policy"
    assert llm._deployment_config.graceful_shutdown_timeout_s == 600.0
    # the command line's JSON
    assert AppArgs.model_validate({"model": "kairos-tiny", "autoscaling_config": '{"min_replicas": 1, '
                                   '"max_replicas": 2}'}).autoscaling_config == {"min_replicas": 1, "max_replicas": 2}
    assert AppArgs.model_validate({"runtime_env": '{"env_vars": {"A": "1"}}'}).runtime_env == {"env_vars": {"A": "1"}}
    # scale to zero: routed however few replicas (the Ingress holds a request while one starts), and a longer wait
    zero = {**cfg["llm_configs"][0], "deployment_config": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 1},
                                                           "ray_actor_options": {"num_gpus": 0}}}
    app = build_openai_app({"llm_configs": [zero]})
    llm = app._bound_deployment.init_args[0]._bound_deployment
    assert llm._deployment_config.autoscaling_config.min_replicas == 0
    settings = app._bound_deployment.init_args[1]
    assert settings["scale_to_zero"]
    assert settings["unready_wait_s"] == settings["cold_start_wait_s"] == COLD_START_WAIT_S
    # (an app whose replicas say they scale to zero where its arguments did not, a Serve config's `deployments:`,
    # waits for a cold start as long, unless unready_wait_s is given)
    fixed = build_openai_app(cfg)._bound_deployment.init_args[1]
    assert (fixed["scale_to_zero"], fixed["unready_wait_s"], fixed["cold_start_wait_s"]) == (False, 30.0,
                                                                                              COLD_START_WAIT_S)
    zero_args = AppArgs.model_validate(translate({"llm_configs": [zero]}))
    assert not zero_args.direct and zero_args.fewest_replicas == 1
    assert AppArgs.model_validate({**translate({"llm_configs": [zero]}), "unready_wait_s": 5}).unready_wait == 5
    assert AppArgs.model_validate(translate(cfg)).unready_wait == 30.0
    with pytest.raises(ValueError, match="min_replicas 0 needs the routed topology"):
        AppArgs.model_validate({**translate({"llm_configs": [zero]}), "topology": "direct"})
    # a vLLM argument Kairos does not have is refused by name, as any unknown argument is, with the nearest one
    cfg["llm_configs"][0]["engine_kwargs"] = {"max_num_seq": 4}
    with pytest.raises(ValueError, match="max_num_seq.*did you mean 'max_num_seqs'"):
        build_openai_app(cfg)


def test_several_llm_configs_are_one_app_of_several_models():
    """Ray Serve LLM's several llm_configs: an LLM deployment per model (`LLMServer:<model_id>`, one replica where
    the config names no count) behind one Ingress; a model's runtime-loaded adapters have nowhere to go there."""
    from deployments import build_openai_app
    from deployments.multi_model import deployment_name, model_of

    def model(name: str, **deployment) -> dict:
        return {"model_loading_config": {"model_id": name, "model_source": "kairos-tiny"},
                "deployment_config": {"ray_actor_options": {"num_gpus": 0}, **deployment}}
    app = build_openai_app({"llm_configs": [model("a/b"), model("c", num_replicas=2)],
                            "ingress_deployment_config": {"num_replicas": 2}})
    ingress = app._bound_deployment
    llms = [d._bound_deployment if hasattr(d, "_bound_deployment") else d for d in ingress.init_args[0]]
    assert ingress.name == "Ingress" and ingress._deployment_config.num_replicas == 2
    assert [(d.name, d._deployment_config.num_replicas) for d in llms] == [("LLMServer:a--b", 1), ("LLMServer:c", 2)]
    assert [s["model_name"] for s in ingress.init_args[1]] == ["a/b", "c"]
    assert deployment_name("org/m-2.5 x") == "LLMServer:org--m-2_5_x"  # (Ray Serve LLM's `/` and `.`)
    with pytest.raises(ValueError, match="names model 0 of the app too"):  # (an adapter named as another model)
        build_openai_app({"llm_configs": [model("a"), {**model("c"), "engine_kwargs": {"lora_modules": "a=/x"}}]})
    assert model_of(b'{"model": "c", "prompt": "x"}') == (True, "c") and model_of(b"[1]") == (False, None)
    assert model_of(b"{not json") == (False, None)
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"):
        build_openai_app({"llm_configs": [model("a"), {**model("c"), "engine_kwargs": {
            "allow_runtime_lora_updating": True}}]})


def test_vllms_runtime_lora_variable_turns_no_adapters_on_in_an_app_of_several(monkeypatch):
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING sets allow_runtime_lora_updating's default, which turns adapters on in an
    engine; an app of several models has no route for them: neither its fronts nor its engines take them (a model
    that cannot serve adapters, model_impl hf, failed to start)."""
    from deployments import build_multi_model_app

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    app = build_multi_model_app([{"model": "kairos-tiny", "served_model_name": n, "num_gpus": 0, "model_impl": impl}
                                 for n, impl in (("a", "auto"), ("b", "hf"))])
    ingress = app._bound_deployment
    assert [s["allow_runtime_lora_updating"] for s in ingress.init_args[1]] == [False, False]
    llms = [d._bound_deployment if hasattr(d, "_bound_deployment") else d for d in ingress.init_args[0]]
    assert [d.init_args[0].get("enable_lora", False) for d in llms] == [False, False]  # (engine configs, as sent)


def test_an_app_of_several_models_has_one_front_given_on_any_model():
    """The front's arguments (API keys, CORS, body limit, the Ingress's replicas) are the app's: given on any one of
    its models they hold for every model; given differently on two, the app is refused naming them (a key set on
    the second model was the first model's none, unseen)."""
    from deployments import build_multi_model_app

    def model(name: str, **args) -> dict:
        return {"model": "kairos-tiny", "served_model_name": name, "num_gpus": 0, **args}
    app = build_multi_model_app([model("a"), model("b", api_keys_env="KAIROS_KEYS", max_body_bytes="4096",
                                                   ingress_num_replicas=2)])
    ingress = app._bound_deployment
    assert ingress._deployment_config.num_replicas == 2
    assert [(s["api_keys_env"], s["max_body_bytes"]) for s in ingress.init_args[1]] == [("KAIROS_KEYS", 4096)] * 2
    build_multi_model_app([model("a", allowed_origins="https://x.org"), model("b", allowed_origins="https://x.org")])
    with pytest.raises(ValueError, match="model 1: api_key_file='/b' where model 0 gives '/a'"):
        build_multi_model_app([model("a", api_key_file="/a"), model("b", api_key_file="/b")])


def test_the_models_of_an_app_split_its_ingress_chunk_budget():
    """One Ingress relays every model's streams: its chunk budget (stream_max_chunks_s a replica of it) is split over
    all the models' replicas, each model's in proportion to its replicas (each model split the whole of it)."""
    from deployments import build_multi_model_app

    app = build_multi_model_app([{"model": "kairos-tiny", "served_model_name": n, "num_gpus": 0, "num_replicas": k,
                                  "stream_max_chunks_s": 3000, "ingress_num_replicas": 2}
                                 for n, k in (("a", 1), ("b", 2))])
    llms = [d._bound_deployment for d in app._bound_deployment.init_args[0]]
    pacings = [d.init_args[4] for d in llms]  # (engine config, metrics interval, prompt logging, cores, pacing, ...)
    assert [p.shared_chunks_per_s for p in pacings] == [2000.0, 4000.0]
    assert [p.max_chunks_per_s for p in pacings] == [2000.0, 2000.0]
    # an autoscaled model counts at its least replicas (at its most, Ray's auto 100, it left the other next to none)
    app = build_multi_model_app([
        {"model": "kairos-tiny", "served_model_name": "a", "num_gpus": 0, "stream_max_chunks_s": 3000,
         "autoscaling_config": {"min_replicas": 1, "max_replicas": 100}},
        {"model": "kairos-tiny", "served_model_name": "b", "num_gpus": 0, "num_replicas": 1,
         "stream_max_chunks_s": 3000}])
    pacings = [d._bound_deployment.init_args[4] for d in app._bound_deployment.init_args[0]]
    assert [p.shared_chunks_per_s for p in pacings] == [1500.0, 1500.0]


def test_a_ray_serve_llm_config_that_names_no_replica_count_gets_one_replica(monkeypatch):
    """Ray Serve LLM's default (autoscaling from 1 to 1): one replica, not Kairos's one per GPU (on a node of 8, the
    config took all 8)."""
    import deployments.args as A
    from deployments import build_openai_app

    monkeypatch.setattr(A, "gpus_for_app", lambda: 8)
    one = {"model_loading_config": {"model_id": "m", "model_source": "kairos-tiny"}}
    top = build_openai_app({"llm_configs": [one]})._bound_deployment
    assert top.name == "LLMServer" and top._deployment_config.num_replicas == 1
    two = {**one, "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 0}}}
    top = build_openai_app({"llm_configs": [two]})._bound_deployment
    assert top.name == "Ingress" and top.init_args[0]._bound_deployment._deployment_config.num_replicas == 2


def test_a_ray_serve_llm_config_chunks_long_prompts_as_vllm_v1_unless_told_not_to():
    """vLLM V1 computes a prompt longer than a step's token budget in chunks by default (Kairos's own default does
    not: its round budget is one that a longer prompt exceeds); enable_chunked_prefill false turns it off."""
    from deployments import _ray_serve_llm_defaults
    from deployments.llm_config import translate

    def chunked(kwargs: dict) -> bool:
        one = {"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"device": "cpu", **kwargs}}
        return _ray_serve_llm_defaults(translate({"llm_configs": [one]}))["chunked_prefill"]
    assert chunked({}) is True and chunked({"max_num_batched_tokens": 512}) is True
    assert chunked({"enable_chunked_prefill": False}) is False
    assert chunked({"chunked_prefill": False}) is False  # (Kairos's name, as given)


def test_num_replicas_auto_autoscales_as_serve_has_it():
    """Serve's `num_replicas: "auto"`: autoscaling from 1 to 100 replicas (it was a bare integer type error)."""
    from deployments.llm_config import translate

    auto = {"model_loading_config": {"model_id": "m"}, "deployment_config": {"num_replicas": "auto"}}
    args = translate({"llm_configs": [auto]})
    assert args["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 100} and "num_replicas" not in args
    from deployments.args import AppArgs

    cfg = AppArgs.model_validate({**args, "model": "kairos-tiny"}).autoscaling()
    assert cfg["max_replicas"] == 100 and cfg["target_ongoing_requests"] > 2
    # with an autoscaling_config beside it, before or after: that config over the auto one's bounds (as Serve's)
    for dep in ({"num_replicas": "auto", "autoscaling_config": None}, {"autoscaling_config": None,
                                                                        "num_replicas": "auto"}):  # (YAML's bare key)
        got = translate({"llm_configs": [{**auto, "deployment_config": dep}]})["autoscaling_config"]
        assert got == {"min_replicas": 1, "max_replicas": 100}, dep
    for given in ({"min_replicas": 2, "max_replicas": 4}, {"target_ongoing_requests": 4}):
        for dep in ({"num_replicas": "auto", "autoscaling_config": given},
                    {"autoscaling_config": given, "num_replicas": "auto"}):
            got = translate({"llm_configs": [{**auto, "deployment_config": dep}]})["autoscaling_config"]
            assert got == {"min_replicas": 1, "max_replicas": 100, **given}, dep
    lora = {**auto, "lora_config": {"dynamic_lora_loading_path": "/a", "download_timeout_s": 30,
                                    "max_download_tries": 3}}
    assert translate({"llm_configs": [lora]})["dynamic_lora_loading_path"] == "/a"  # (Ray's download knobs: no effect)


def test_a_ray_serve_llm_replica_asks_for_a_gpu_unless_its_config_says_the_cpu():
    """Ray Serve LLM's replica asks for a GPU (vLLM's placement), and waits where none is free yet: a cluster that
    adds GPU nodes on demand shows none when the app is built, and Kairos's own default (the CPU where no GPU is
    found) put every replica of such a config on the CPU, saying so only in an info line. ray_actor_options'
    num_gpus, or device cpu among the engine_kwargs, serves on the CPU."""
    from deployments import build_openai_app

    base = {"model_loading_config": {"model_id": "tiny", "model_source": "kairos-tiny"},
            "engine_kwargs": {"dtype": "float32"}}

    def gpus(cfg: dict) -> float:
        return build_openai_app({"llm_configs": [cfg]})._bound_deployment._replica_config.ray_actor_options["num_gpus"]
    assert gpus(base) == 1.0  # (this box has no GPU)
    assert gpus({**base, "engine_kwargs": {"dtype": "float32", "device": "cpu"}}) == 0.0
    assert gpus({**base, "deployment_config": {"ray_actor_options": {"num_gpus": 0}}}) == 0.0
    assert gpus({**base, "deployment_config": {"ray_actor_options": {"num_gpus": 0.5}}}) == 0.5
    assert gpus({**base, "engine_kwargs": {"dtype": "float32", "device": "cuda:1"}}) == 0.0  # (Kairos's: its device)


def test_real_configs_fields_are_taken_merged_or_refused_as_ray_serve_llm_means_them():
    """What a helper's run of real Ray Serve LLM configs found: vLLM arguments that change nothing here are taken
    (they were refused as unknown); a model_source URI is refused as a cloud mirror at build time (replicas failed
    to load it); the LLMConfig's runtime_env and ray_actor_options' are merged, the LLMConfig's winning key by key
    (one replaced the other: a gated model's HF_TOKEN went missing); a placement group of one bundle is a replica's
    GPUs and CPUs (it was refused); a seed of null is vLLM's none."""
    base = {"model_loading_config": {"model_id": "m"}}

    def one(**cfg) -> dict:
        return translate({"llm_configs": [{**base, **cfg}]})
    assert one(engine_kwargs={"guided_decoding_backend": "xgrammar", "use_tqdm_on_load": False, "seed": None,
                              "enable_reasoning": True, "config_format": "auto", "response_role": "assistant"}) \
        == {"model": "m", "served_model_name": "m"}
    for uri in ("s3://bucket/llama", "gs://b/m"):
        with pytest.raises(ValueError, match="model_source: a cloud mirror"):
            one(model_loading_config={"model_id": "m", "model_source": uri})
    got = one(runtime_env={"env_vars": {"A": "llm"}}, engine_kwargs={"hf_token": "hf_x"}, accelerator_type="A10G",
              deployment_config={"ray_actor_options": {
                  "runtime_env": {"pip": ["x"], "env_vars": {"A": "dep", "B": "1"}}, "accelerator_type": "L4"}})
    assert got["runtime_env"] == {"pip": ["x"], "env_vars": {"A": "llm", "B": "1", "HF_TOKEN": "hf_x"}}
    assert got["accelerator_type"] == "A10G"
    assert one(placement_group_config={"bundles": [{"GPU": 0.49, "CPU": 1}]})["num_gpus"] == 0.49
    assert one(placement_group_config={"bundle_per_worker": {"GPU": 1}})["num_gpus"] == 1.0
    assert one(placement_group_config={"bundles": [{"CPU": 4}]}) == {"model": "m", "served_model_name": "m",
                                                                     "num_gpus": 0.0, "num_cpus": 4.0}  # (the CPU)
    # vLLM's command-line spellings among engine_kwargs: a front setting too, whichever model gives it
    assert one(engine_kwargs={"api-keys-env": "KEYS", "max-num-seqs": 8}) == {
        "model": "m", "served_model_name": "m", "api_keys_env": "KEYS", "max_num_seqs": 8}
    for bad in ({"bundles": [{"GPU": 1}, {"GPU": 1}]}, {"bundles": [{"GPU": 2}]}, {"bundles": [{"TPU": 1}]}):
        with pytest.raises(ValueError, match="placement_group_config: one bundle"):
            one(placement_group_config=bad)
    # two counts of adapters kept loaded: refused (the lora_config's won in silence), one of them, or both alike, taken
    with pytest.raises(ValueError, match="max_num_adapters_per_replica: 16, where engine_kwargs.max_loras is 4"):
        one(engine_kwargs={"max_loras": 4}, lora_config={"max_num_adapters_per_replica": 16})
    assert one(engine_kwargs={"max_loras": 4}, lora_config={"max_num_adapters_per_replica": 4})["max_loras"] == 4
    # vLLM's enable_auto_tool_choice false: tool_choice auto is a 400 there, whatever the parser (it was no effect)
    assert one(engine_kwargs={"enable_auto_tool_choice": False, "tool_call_parser": "hermes"})["tool_call_parser"] \
        == "none"
    assert "tool_call_parser" not in one(engine_kwargs={"enable_auto_tool_choice": True})


def test_the_command_lines_app_arguments_take_vllms_names_as_an_llm_config_does():
    """`serve run deployments:app key=value`: vLLM's engine arguments as engine_kwargs takes them (they were unknown
    there, though an LLMConfig took them), dashes for underscores; vLLM's JSON list of origins (it became one origin
    spelled as the list, refusing every browser); a list of served names is refused, not taken as one name."""
    from pydantic import ValidationError

    from deployments import AppArgs

    def given(**kw) -> dict:
        a = AppArgs.model_validate(kw)
        return {k: getattr(a, k) for k in a.model_fields_set}
    assert given(**{"max-model-len": "256", "enable_chunked_prefill": "true", "max_num_batched_tokens": "512",
                    "tensor_parallel_size": "1", "enable_auto_tool_choice": "true"}) \
        == {"max_model_len": 256, "chunked_prefill": True, "prefill_max_tokens": 512}
    # vLLM's max_num_batched_tokens caps every step: a longer prompt is computed in chunks (Kairos's own
    # prefill_max_tokens alone stays a round's budget, as it was)
    assert given(max_num_batched_tokens="512") == {"chunked_prefill": True, "prefill_max_tokens": 512}
    assert given(max_num_batched_tokens="512", chunked_prefill="false") \
        == {"chunked_prefill": False, "prefill_max_tokens": 512}  # (Kairos's own name stands)
    assert given(max_num_batched_tokens="512", enable_chunked_prefill="false") \
        == {"chunked_prefill": False, "prefill_max_tokens": 512}
    assert given(prefill_max_tokens="512") == {"prefill_max_tokens": 512}
    with pytest.raises(ValidationError, match="tensor_parallel_size: 2: a Kairos replica runs its model on one GPU"):
        AppArgs.model_validate({"tensor_parallel_size": "2"})
    assert given(allowed_origins='["https://a.example", "https://b.example"]')["allowed_origins"] \
        == "https://a.example,https://b.example"
    assert given(allowed_origins=["https://a.example"])["allowed_origins"] == "https://a.example"
    for names in ('["a", "b"]', ["a", "b"]):
        with pytest.raises(ValidationError, match="served_model_name: one name here"):
            AppArgs.model_validate({"served_model_name": names})
