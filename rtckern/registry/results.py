"""Result records of probing: reasons (data, not text in a buffer), per-candidate outcomes, selections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from rtckern.registry.candidate import Candidate, Cost
    from rtckern.registry.request import OpRequest
    from rtckern.spec import KernelSpec

# The stage at which a candidate was rejected, in probe order.
STAGES = ("override", "arch", "supports", "specs", "compile", "load", "resources", "numeric")


@dataclass(frozen=True)
class Reason:
    """Why a candidate was rejected: the probe stage and a message that names the value and the limit."""

    stage: str
    message: str

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown probe stage {self.stage!r}; stages: {STAGES}")

    def __str__(self) -> str:
        return f"{self.stage}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"stage": self.stage, "message": self.message}

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> "Reason":
        return cls(stage=d["stage"], message=d["message"])


@dataclass(frozen=True)
class ProbeResult:
    """One candidate's outcome for one request.

    accepted: passed every stage that was run. probed: False when it was not tried (a better-ranked candidate
    was chosen first, or an override took it out), in which case accepted is False. checks: the stages that ran.
    from_store: the compile/load/resource outcome was read from the persisted decisions, not re-probed.
    cost: its expected cost (None: no estimate, or it cannot serve). rank: its place (1 = first) among the
    candidates that can serve, None for the others.
    """

    name: str
    priority: int
    accepted: bool
    reasons: tuple[Reason, ...] = ()
    specs: tuple["KernelSpec", ...] = ()
    cache_keys: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    probed: bool = True
    from_store: bool = False
    cost: "Cost | None" = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        c = self.cost
        return {
            "name": self.name, "priority": self.priority, "accepted": self.accepted, "probed": self.probed,
            "rank": self.rank, "cost": None if c is None else {"value": c.value, "source": c.source,
                                                               "detail": c.detail},
            "reasons": [str(r) for r in self.reasons], "reason_data": [r.to_dict() for r in self.reasons],
            "checks": list(self.checks), "from_store": self.from_store,
            "specs": [spec_to_dict(s) for s in self.specs], "cache_keys": list(self.cache_keys),
        }


@dataclass(frozen=True)
class Selection:
    """The chosen candidate for a request, with its kernels loaded on the request's device (an empty tuple for
    a hand-described device: compile-only). `results`: every candidate's result, those that can serve first in
    rank order (probed up to and including the chosen), then the rejected ones."""

    request: "OpRequest"
    candidate: "Candidate"
    specs: tuple["KernelSpec", ...]
    kernels: tuple[Any, ...]
    results: tuple[ProbeResult, ...] = field(default=(), repr=False)

    @property
    def name(self) -> str:
        return self.candidate.name

    def launch(self, *args: Any, **kwargs: Any) -> Any:
        return self.candidate.launch(self.request, self.kernels, *args, **kwargs)


def spec_to_dict(spec: "KernelSpec") -> dict[str, Any]:
    return {
        "source": spec.source, "name": spec.name, "template_args": [_plain(a) for a in spec.template_args],
        "defines": [_plain(d) for d in spec.defines], "options": list(spec.options),
        "arch": getattr(spec.arch, "sm", str(spec.arch)),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return str(value)
