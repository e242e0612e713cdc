"""Errors the engine's callers catch (torch-free, so a client process can import them)."""


class EngineDeadError(RuntimeError):
    """The engine's worker (thread or process) is not running: no request can be accepted."""
