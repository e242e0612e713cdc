"""Engine configuration (validated). The scheduler's knobs live in `scheduling.config`."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.sampling import MAX_LOGPROBS
from engine.lora import MAX_RANK_LIMIT, LoraServing, LoraSpec, ModelShape
from scheduling.config import SchedulerConfig

# "1": the CPU kernels' parallel loops (engine/backends/cpu/) run on Kairos's own thread team instead of OpenMP
# regions. The team does not wait for a thread that another process keeps off its core, as OpenMP's static shares
# and join barriers do: for an engine that shares its cores (a served engine beside the HTTP ingress). Set it with
# OMP_WAIT_POLICY=PASSIVE before torch loads, or torch's OpenMP workers spin on the team's cores after each torch op
# (`EngineCoreClient(team=True)` sets both).
TEAM_ENV = "KAIROS_CPU_TEAM"
# The nice value the team's worker threads take (they inherit their creator's otherwise): a favoured engine process
# (engine/core_proc.py) runs its own thread at nice 0 and leaves its workers at the priority it was started with.
TEAM_NICE_ENV = "KAIROS_CPU_TEAM_NICE"

DEFAULT_MODEL = "kairos-default"  # SmolLM2-135M-Instruct; kairos-random-42m / kairos-tiny: random weights
# A GPU replica's scheduler defaults, for the knobs its config leaves unset (`for_device`): a GPU step runs
# batches in the hundreds for about the time of a few, as vLLM's defaults (256 running requests) assume; and kairos's
# VBS gate counts a share of the prefill stalls its ITL correction measures (`correction_stall_share`), starting at
# half and following the paced replies that miss their TPOT (`stall_share_target`): all of them turned away requests
# that catch-up keeps within their TPOT there; none, under sustained overload, admitted more than the steps could
# pace. Its length predictions keep ShareGPT's scale (`length_calibration` off): scaled down to a model that answered
# shorter, the gate planned shorter contexts and admitted more than the steps paced (bench/README has the
# simulator's figures)
GPU_SCHEDULER_DEFAULTS: dict[str, Any] = {"max_num_seqs": 256, "max_waiting": 512, "prefill_max_tokens": 2048,
                                          "correction_stall_share": 0.5, "stall_share_target": 0.01,
                                          "length_calibration": False, "prefill_hold_replies": 3}
# And a policy's own, on top: kairos's VBS gate plans with the ITL its correction measured and no static margin
# (`vbs_margin` 1.0): a GPU's decode steps vary little around what the correction follows, and a reply's TPOT averages
# hundreds of them; with the CPU's 1.05 the simulator replaying an H200 lease left goodput unserved at no TPOT gained
# (bench/README). SCORPIO keeps its published margin.
GPU_POLICY_DEFAULTS: dict[str, dict[str, Any]] = {"kairos": {"vbs_margin": 1.0}}
SUPPORTED_FAMILIES: tuple[str, ...] = ("gpt2", "llama", "qwen2", "mistral", "qwen3")  # config.json's model_type


def check_family(model: str, family: Any) -> None:
    """ValueError unless `family` (a checkpoint's model_type) is one the engine runs."""
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"cannot load model {model!r}: unsupported model family {family!r}; "
                         f"supported: {', '.join(SUPPORTED_FAMILIES)}")


def check_local_model(model: str, max_model_len: int | None = None) -> None:
    """Where `model` is a directory here with a readable config.json, `check_family` on it, and a `max_model_len`
    past the positions it takes (`loader.model_max_len`) refused; a file, a directory without config.json, or a
    config.json that is not JSON, a ValueError: where an app is built (`deployments.args`), so that `serve run`
    refuses a checkpoint its replicas would fail to load at once instead of after Serve's retries (a path that is a
    directory here must be the checkpoint the replicas read). Anything else (a built-in name, a hub id, a path only
    the cluster's nodes have) is left to the loader."""
    from engine.default_model import EMBEDDED_MODELS

    if not model or model in EMBEDDED_MODELS:  # (a built-in name is the loader's, whatever folder is named so here)
        return
    folder = os.path.expanduser(model)
    if os.path.isfile(folder):
        raise ValueError(f"cannot load model {model!r}: it is a file, expected a checkpoint directory")
    path = os.path.join(folder, "config.json")
    if os.path.isdir(folder) and not os.path.isfile(path):
        raise ValueError(f"cannot load model {model!r}: no config.json in {folder}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        family = raw.get("model_type")
    except OSError:
        return
    except (ValueError, AttributeError) as e:
        raise ValueError(f"cannot load model {model!r}: its config.json is not a JSON object ({e})") from None
    check_family(model, family)
    if max_model_len is not None:
        from transformers import AutoConfig

        from engine.loader import model_max_len

        try:  # (as the loader reads it: transformers resolves rope_scaling beside the rope_parameters it wrote)
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except Exception:  # noqa: BLE001 - what transformers cannot read is the loader's to refuse, naming why
            return
        top = model_max_len(config)
        if top is not None and max_model_len > top:  # (the loader's refusal, as its replicas would give it)
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's maximum context of {top} positions "
                             f"({model})")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="local HF dir, hub id, or kairos-default / kairos-random-42m / kairos-tiny")
    tokenizer: str | None = None
    chat_template: str | None = Field(
        None, description="vLLM's --chat-template: the chat template chats are rendered with, in place of the "
                          "tokenizer's (a model without one, or one to mend): a file's path, read where the app is "
                          "built, or the template itself, as it is")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="auto: the checkpoint's weights; dummy: random weights of its config.json, no weight file "
                            "read (vLLM's --load-format dummy): for measuring speed, its replies mean nothing")
    dtype: Literal["auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"] = "auto"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    trust_remote_code: bool = False
    generation_config: Literal["auto", "vllm"] = Field(
        "auto", description="vLLM's --generation-config: auto: a request that leaves temperature, top_p, top_k, min_p "
        "or repetition_penalty out takes the value the model's generation_config.json recommends; vllm: the server's "
        "own defaults (temperature 1, top_p 1, none of the others)")
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads (default: all cores in process; "
                                      "a Serve replica's: deployments.replica.engine_threads, 1 on a GPU)")
    max_model_len: int | None = Field(None, gt=0, description="context window (default: the model's)")
    # paged KV cache
    block_size: int = Field(16, gt=0, le=1024)
    num_kv_blocks: int | None = Field(None, gt=0, description="explicit cache size in blocks")
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="cache size as a memory budget")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="CUDA: share of the GPU's memory this "
                                          "engine may hold, weights and KV cache together")
    kv_cache_dtype: Literal["auto", "model", "float32", "bfloat16", "float16"] = "auto"
    cpu_upcast_matmul: Literal["auto", "on", "off"] = Field(
        "auto", description="bf16/fp16 on CPUs without native half GEMM: run multi-row matmuls in fp32")
    model_impl: Literal["auto", "kairos", "hf"] = Field(
        "auto", description="kairos: our own forward (Llama-family); hf: the HF modules' forward; auto: ours when it supports the model")
    backend: Literal["auto", "torch", "cpu", "cuda"] = Field(
        "auto", description="the device backend (engine/backends): auto: the device's own (cpu or cuda); torch: the "
                            "device-agnostic torch reference")
    kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="the backend's own kernels. CPU: Kairos's compiled kernels for RMSNorm, RoPE + cache "
                            "write, paged decode attention, sampling and packed GEMMs (built at first use with the "
                            "system's C++ compiler); CUDA: Triton paged attention and CUDA graphs. auto: where they "
                            "run, else torch ops; on: refuse to start without them; off: torch ops")
    mixed_graph_tokens: int = Field(
        512, ge=0, le=2048, description="CUDA: steps with prefill rows (prompts, chunks, and the decodes riding with "
                                        "them) of up to this many tokens replay CUDA graphs captured at start (token "
                                        "counts 16, 32, ... up to it), instead of an eager forward whose per-op host "
                                        "work costs more than the GPU's; 0: they run eagerly")
    enforce_eager: bool = Field(
        False, description="CUDA: capture no CUDA graphs, every step runs eagerly (vLLM's enforce_eager; Triton "
                           "attention stays: kernels=off turns that off too)")
    max_logprobs: int = Field(
        MAX_LOGPROBS, ge=-1, description="vLLM's: the most likely tokens a request may ask the log-probabilities of "
                                         "per token (logprobs, top_logprobs, prompt_logprobs); -1: the vocabulary")
    max_tokens_over_context: Literal["clamp", "reject"] = Field(
        "clamp", description="a max_tokens beyond the context left: clamp (the reply ends at the window, as an "
                             "in-process engine does) or reject (ValueError; the OpenAI server's 400, as vLLM's)")
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="overlap scheduling: plan and launch step N+1 while the device still runs step N (its "
                            "sampled tokens feed N+1 on the device; the host learns them one step later, so a reply "
                            "that ends at N costs one discarded row in N+1). auto: on for CUDA, off on the CPU. "
                            "on, on the CPU: the steps run on a thread of their own while the worker does the host "
                            "work (`engine.host_stream`); best with num_threads=1 and another core")
    step_timeout_s: float | None = Field(
        None, ge=0, description="a turn of the engine's worker (a model step) that runs longer than this means the "
                                "device or the worker hung: the engine fails its requests as unavailable (503; the "
                                "Ingress resends those with no token yet to another replica), logs where the "
                                "worker is stuck and reports itself dead, so that Serve's health check replaces "
                                "the replica. None: the larger of 120 s and 10x the latency model's largest step "
                                "(or of the step at hand); 0: never")
    gc_threshold: int = Field(
        50_000, ge=0, description="while the engine runs, the collector's first threshold (allocations less "
                                  "deallocations between young collections) is at least this, process-wide as the "
                                  "start-up freeze is, until the last engine's worker exits: each step allocates "
                                  "thousands of short-lived objects, and Python's 700 runs the collector several "
                                  "times a step; 0: leave Python's")
    enable_lora: bool = Field(
        False, description="vLLM's --enable-lora: serve LoRA adapters (PEFT folders) beside the model, a request "
                           "naming one as its `model`; on where lora_modules are given")
    lora_modules: list[dict[str, str]] | dict[str, str] | str = Field(  # (vLLM's list of {name, path} once validated)
        default_factory=dict, description="vLLM's --lora-modules: the adapters to serve, name=path (several: "
                                          "comma-separated, or a JSON list of {\"name\", \"path\"}, or a mapping)")
    dynamic_lora_loading_path: str | None = Field(
        None, description="Ray Serve LLM's: a folder of adapter folders; a request whose model is "
                          "`<served model>:<folder name>` runs through that adapter, loaded at its first request")
    max_loras: int = Field(16, gt=0, description="adapters kept loaded (Ray Serve LLM's max_num_adapters_per_"
                                                 "replica): past it, the least recently used one loaded on demand that "
                                                 "no request holds is unloaded (one a request holds never is: while "
                                                 "requests hold them, more may be loaded)")
    max_lora_rank: int = Field(16, gt=0, le=MAX_RANK_LIMIT, description="vLLM's: the largest adapter rank served")
    lora_load_timeout_s: float = Field(300.0, ge=0, description="an adapter loaded on demand or at run time that has "
                                       "not loaded within this long (its files unreadable: a hung mount) fails the "
                                       "requests that wait for it (503: retry), and later loads go to a new loader "
                                       "thread; 0: wait for it however long")
    seed: int = 0
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        """auto, cpu, cuda or cuda:N, at once (an app's replicas failed their starts on another, the reason at the
        end of Serve's traceback); whether this host has CUDA is the replica's host's to say."""
        d = str(v).strip().lower()
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", d):
            raise ValueError(f"device {v!r}: expected auto, cpu, cuda or cuda:N")
        return d

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        return load_chat_template(v)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, v: Any) -> list[dict[str, str]]:
        return [{"name": s.name, "path": s.path} for s in LoraSpec.parse(v)]

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _lora_dir(cls, v: str | None) -> str | None:
        if v and "://" in v:  # (Ray Serve LLM's s3://, gs://, ...: abspath would make a local path of it)
            raise ValueError(f"dynamic_lora_loading_path {v!r}: adapters are read from a folder the replicas' hosts "
                             "share, not from a remote store: copy them there (or mount the bucket) and give its path")
        return os.path.abspath(os.path.expanduser(v)) if v else None  # (where the app is built: see LoraSpec.parse)

    def lora_paths(self) -> dict[str, str]:
        """The adapters of `lora_modules`: name -> folder."""
        return {m["name"]: m["path"] for m in self.lora_modules}  # (validated: a list of {name, path})

    @property
    def serves_lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or bool(self.dynamic_lora_loading_path)

    def lora_serving(self, shape: ModelShape) -> LoraServing:
        """What a request may name of the adapters served, for a model of `shape` (`InputProcessor`)."""
        return LoraServing(frozenset(self.lora_paths()), self.dynamic_lora_loading_path, shape, self.max_lora_rank)


def load_chat_template(value: str | None) -> str | None:
    """vLLM's `--chat-template` value as a template: a value with none of Jinja's marks (`{`, `}`, a line break) is a
    file's path, whose text it is (a ValueError where it cannot be read, or holds none of those marks: no template);
    any other value is the template, as it is (its line breaks its own: a one-line value's `\\n` is not read as one).
    So the text it returns is returned as it is when read again (the app's builder, its replicas and their engine
    processes each validate the engine's config)."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat_template {value!r} looks like a file's path, but it cannot be read ({e})") from None
    if not any(c in text for c in "{}\n"):
        raise ValueError(f"chat_template {value!r}: the file holds no Jinja template")
    return text


def with_overrides(config: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    """`config` with these fields given too, validated as given ones are (the knobs given stay those given)."""
    if not overrides:
        return config
    return EngineConfig.model_validate({**config.model_dump(exclude_unset=True), **overrides})


def for_device(config: "EngineConfig", device_type: str) -> "EngineConfig":
    """`config` with the scheduler defaults of an engine on `device_type` where its knobs were not given: on CUDA
    `GPU_SCHEDULER_DEFAULTS` and its policy's `GPU_POLICY_DEFAULTS`, on a CPU the configs' own. The engine applies
    it once it knows its device; a config keeps which knobs were given across processes by being sent without its
    defaults (`exclude_unset`)."""
    sched = config.scheduler
    if device_type != "cuda":
        return config
    defaults = GPU_SCHEDULER_DEFAULTS | GPU_POLICY_DEFAULTS.get(sched.policy, {})
    update = {k: v for k, v in defaults.items() if k not in sched.model_fields_set}
    if not update:
        return config
    return config.model_copy(update={"scheduler": sched.model_copy(update=update)})


# The scheduler knobs a running engine keeps whatever `reconfigured` is asked: they sized its KV cache and CUDA
# graphs (the warm-up step's activations: max_num_seqs decodes beside the longest prefill a step can run) or chose
# its latency profile. A new deployment changes them.
FIXED_SCHEDULER_KNOBS: tuple[str, ...] = ("max_num_seqs", "prefill_max_tokens", "chunked_prefill", "predictor_path")


def reconfigured(given: SchedulerConfig, running: SchedulerConfig, overrides: dict[str, Any],
                 device_type: str) -> SchedulerConfig:
    """The scheduler config of a running engine that is asked for `overrides` (SchedulerConfig knobs by name, e.g.
    {"policy": "scorpio"}): the knobs it was started with (`given`, before any device default) with `overrides` on
    top, and then its device's defaults where neither set a knob (`for_device`: a GPU's follow the new policy).
    `overrides` replace whatever an earlier call asked, as a Serve deployment's `user_config` does. ValueError for an
    unknown knob, a bad value, a change of one of `FIXED_SCHEDULER_KNOBS` (from `running`, the config it runs), or a
    length predictor file that does not load (the new scheduler is built once the old one has drained: a failure
    there is only logged, and the old one stays)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"scheduler knobs must be a mapping of name to value, got {type(overrides).__name__}")
    cfg = SchedulerConfig.model_validate({**given.model_dump(exclude_unset=True), **overrides})
    engine = for_device(EngineConfig(scheduler=cfg), device_type).scheduler
    fixed = [k for k in FIXED_SCHEDULER_KNOBS if getattr(engine, k) != getattr(running, k)]
    if fixed:
        raise ValueError(", ".join(f"{k} ({getattr(running, k)!r} -> {getattr(engine, k)!r})" for k in fixed)
                         + " cannot change while the engine runs: it sized the KV cache and CUDA graphs or chose the "
                         "latency profile at start; deploy the change as an application argument (a new replica)")
    if engine.length_predictor_path is not None:
        from scheduling.length_predictor import load_cached

        try:
            load_cached(engine.length_predictor_path)
        except Exception as e:  # noqa: BLE001 - any reason it does not load is the caller's to hear
            raise ValueError(f"length_predictor_path: {engine.length_predictor_path!r} does not load: {e}") from None
    return engine
