"""The servers tests start take their ports from bench.ports (below the ephemeral range, above Ray's worker ports)."""
from bench.ports import HIGH, LOW, free_port

__all__ = ["HIGH", "LOW", "free_port"]
