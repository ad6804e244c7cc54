"""Status: the outcome of a call, with gRPC's codes (the C++ client's hiqcache::Status)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from grpc import StatusCode

__all__ = ["HiqError", "Status", "StatusCode"]


@dataclass(frozen=True)
class Status:
    code: StatusCode = StatusCode.OK
    message: str = ""

    OK: ClassVar[Status]

    @property
    def ok(self) -> bool:
        return self.code == StatusCode.OK

    def __str__(self) -> str:
        return "OK" if self.ok else f"{self.code.name}: {self.message}"


Status.OK = Status()


class HiqError(Exception):
    """Raised by the calls that are not fail-open (register_pool, evict, get_stats)."""

    def __init__(self, status: Status):
        super().__init__(str(status))
        self.status = status
