"""Errors the engine's callers catch (torch-free, so a client process can import them)."""


class EngineDeadError(RuntimeError):
    """The engine's worker (thread or process) is not running: no request can be accepted."""


class EngineHungError(EngineDeadError):
    """The engine's worker has been stuck in one turn (a model step) past `EngineConfig.step_timeout_s`: the
    engine failed its requests and counts as dead, though its thread may still be blocked in the device call."""


# the exit status of an engine process whose worker hung (`engine.core_proc`): its client reports the hang by it
HUNG_EXIT_CODE = 75
