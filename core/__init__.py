"""The neutral core: plain types every layer shares. It imports neither torch nor any other Kairos package.

Imports run one way: deployments -> engine -> scheduling -> core.
"""
from core.kv import BlockManager
from core.messages import (
    ChatTurn, ErrorKind, GenerateRequest, ProtocolError, RejectReason, RequestMetrics, RequestOutput, RoutingStats,
    ServedBy,
)
from core.request import SLO, FinishReason, Request, Status
from core.sampling import SamplingParams

__all__ = [
    "SLO", "BlockManager", "ChatTurn", "ErrorKind", "FinishReason", "GenerateRequest", "ProtocolError",
    "RejectReason", "Request", "RequestMetrics", "RequestOutput", "RoutingStats", "SamplingParams", "ServedBy",
    "Status",
]
