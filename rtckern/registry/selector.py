"""`Registry`: candidates per op, memoized selection, overrides from the settings, and explain.

Hot path: `select(req)` is one dict lookup once a request has been decided. The first call for a request takes
that request's lock (concurrent first calls probe once), ranks the candidates that can serve it by expected cost
(then priority), probes them in that order and remembers the outcome, failures included, in memory and in the
decision store on disk.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from rtckern import config, events
from rtckern.caches import PlanCache
from rtckern.errors import ConfigError, UnsupportedRequestError
from rtckern.registry import core_api
from rtckern.registry.candidate import Candidate, Cost, check_declaration, rank_key
from rtckern.registry.probe import cheap_check, mode_of, probe_ranked
from rtckern.registry.request import OpRequest
from rtckern.registry.results import ProbeResult, Reason, Selection
from rtckern.registry.store import DecisionStore

DISABLE_SETTING = "RTCKERN_DISABLE_OPS"  # RTCKERN_DISABLE_JIT is its deprecated old name (rtckern.config)
FORCE_SETTING = "RTCKERN_FORCE_IMPL"


class _Failed:
    """A memoized 'nothing serves this request': raising again costs no probe."""

    __slots__ = ("error",)

    def __init__(self, error: UnsupportedRequestError) -> None:
        self.error = error


class Registry:
    def __init__(self, store_dir: Any = ..., *, numeric: bool | None = None) -> None:
        """store_dir: where decisions persist; `...` (default) follows the settings (<cache_dir>/decisions,
        off when RTCKERN_PERSIST_DECISIONS=0); None keeps decisions in memory only. numeric: force the
        numerical probe on/off; None follows RTCKERN_NUMERICAL_PROBE."""
        self._store_dir = store_dir
        self._numeric = numeric
        self._candidates: dict[str, list[Candidate]] = {}
        self._by_name: dict[str, Candidate] = {}
        self._memo = PlanCache("registry.selections", 1 << 16)
        self._memo_settings: Any = None
        self._key_locks: dict[OpRequest, threading.Lock] = {}
        self._lock = threading.RLock()
        self._builders: dict[str, "BuilderEntry"] = {}
        self.probe_count = 0  # candidates probed past the cheap checks (tests assert memoization with it)

    # -- registration ---------------------------------------------------------------------------------------------
    def register(self, cand: Candidate, *, replace: bool = False) -> Candidate:
        check_declaration(cand)
        with self._lock:
            old = self._by_name.get(cand.name)
            if old is not None and not replace:
                raise ValueError(f"candidate {cand.name!r} is already registered ({old!r}); pick another name or "
                                 "pass replace=True")
            if old is not None:
                self._candidates[old.op].remove(old)
            self._by_name[cand.name] = cand
            lst = self._candidates.setdefault(cand.op, [])
            lst.append(cand)
            lst.sort(key=lambda c: (-c.priority, c.name))  # priority order, ties by name: deterministic
            self._memo.clear()
        return cand

    def register_request_builder(self, op: str, fn: "RequestBuilder", *, help: str = "",
                                 example: str = "", replace: bool = False,
                                 limits: "LimitProbe | None" = None) -> None:
        """Let `explain`, `tune` and `selftest` build op's request from a shape string: fn(shape: tuple[int, ...],
        dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest. dtype is None when not given (use
        the op's main dtype); options are the CLI's --opt key=value pairs, as strings. help: one line naming
        what shape means and which options exist; example: an argument line (`--dtype bf16 --shape 8192x4096`);
        limits: the dimension whose served values `rtckern ops` shows (probed through the candidates)."""
        with self._lock:
            if op in self._builders and not replace:
                raise ValueError(f"op {op!r} already has a request builder ({self._builders[op].fn!r}); pass "
                                 "replace=True to swap it")
            self._builders[op] = BuilderEntry(op, fn, help, example, limits)

    def request_builder(self, op: str) -> "BuilderEntry":
        try:
            return self._builders[op]
        except KeyError:
            known = sorted(self._builders)
            raise KeyError(f"op {op!r} has no request builder; ops with one: {known or '(none: import rtckern.ops)'}"
                           ) from None

    def builder_ops(self) -> tuple[str, ...]:
        return tuple(sorted(self._builders))

    def candidates(self, op: str) -> tuple[Candidate, ...]:
        return tuple(self._candidates.get(op, ()))

    def ops(self) -> tuple[str, ...]:
        return tuple(sorted(self._candidates))

    def get(self, name: str) -> Candidate:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no candidate named {name!r}; registered: {sorted(self._by_name)}") from None

    def reset(self) -> None:
        """Forget in-memory decisions (persisted ones stay)."""
        with self._lock:
            self._memo.clear()

    # -- selection ------------------------------------------------------------------------------------------------
    def select(self, req: OpRequest) -> Selection:
        found = self._memo.get(req)
        if found is not None and self._memo_settings is config.settings():
            if found.__class__ is Selection:
                return found  # type: ignore[return-value]
            raise found.error  # type: ignore[union-attr]
        return self._select_slow(req)

    def _select_slow(self, req: OpRequest) -> Selection:
        s = config.settings()
        with self._lock:
            if self._memo_settings is not s:  # settings changed (config.override): old decisions may not hold
                self._memo.clear()
                self._memo_settings = s
            lock = self._key_locks.setdefault(req, threading.Lock())
        with lock:
            found = self._memo.get(req)
            if found is None:
                found = self._decide(req, s)
                with self._lock:
                    if self._memo_settings is s:
                        self._memo.put(req, found)
                    if self._key_locks.get(req) is lock:  # decided and memoized: later callers find the memo, so
                        del self._key_locks[req]  # the lock goes (one per distinct request grew without bound)
                if found.__class__ is Selection and events.listening(events.SelectionEvent):
                    events.emit(events.SelectionEvent(req, found.candidate.name))  # record mode listens
        if isinstance(found, _Failed):
            raise found.error
        return found

    def _decide(self, req: OpRequest, s: Any) -> Selection | _Failed:
        results, chosen, kernels = self.probe(req, stop_at_first=True, settings=s)
        if chosen is None:
            return _Failed(unsupported_error(req, results, s))
        cand = self._by_name[chosen.name]
        return Selection(request=req, candidate=cand, specs=chosen.specs, kernels=kernels, results=tuple(results))

    def rank(self, req: OpRequest, settings: Any = None
             ) -> tuple[list[tuple[Candidate, Cost | None]], list[ProbeResult]]:
        """The candidates that can serve req (overrides applied, arch range and supports() passed) with their
        expected costs, in the order select() probes them: by cost, then priority (`rank_key`); and the others'
        rejections, in priority order."""
        s = settings if settings is not None else config.settings()
        cands = self.candidates(req.op)
        skip = self._override_reasons(req.op, cands, s)
        ranked: list[tuple[Candidate, Cost | None]] = []
        rejected: list[ProbeResult] = []
        for cand in cands:
            if cand.name in skip:
                rejected.append(ProbeResult(cand.name, cand.priority, False, (skip[cand.name],), probed=False))
                continue
            why = cheap_check(cand, req)
            if why is not None:
                rejected.append(why)
                continue
            cost = cand.cost(req)
            if cost is not None and not isinstance(cost, Cost):
                raise TypeError(f"candidate {cand.name!r}: cost() returned {cost!r}; expected a Cost or None")
            ranked.append((cand, cost))
        ranked.sort(key=lambda pair: rank_key(*pair))
        return ranked, rejected

    def probe(self, req: OpRequest, *, stop_at_first: bool, settings: Any = None, numeric: bool | None = None,
              fresh: bool = False) -> tuple[list[ProbeResult], ProbeResult | None, tuple[Any, ...]]:
        """Rank the op's candidates for req (`rank`) and probe them in that order. Returns every candidate's
        result (those that can serve in rank order, then the rejected ones), the chosen one's result (None if
        none serves) and its loaded kernels. numeric: run the numerical probe (default: the registry's / the
        setting's). fresh: ignore stored outcomes (the new ones are still stored)."""
        s = settings if settings is not None else config.settings()
        ranked, rejected = self.rank(req, s)
        if numeric is None:
            numeric = self._numeric if self._numeric is not None else s.numerical_probe
        store = DecisionStore(self._store_root(s))
        mode = mode_of(req)
        path = store.path(req.op, req.digest(), mode, core_api.toolchain(mode, req.device))
        stored = {} if fresh else store.load(path)
        results: list[ProbeResult] = []
        chosen: ProbeResult | None = None
        kernels: tuple[Any, ...] = ()
        for i, (cand, cost) in enumerate(ranked, 1):
            if chosen is not None and stop_at_first:
                results.append(ProbeResult(cand.name, cand.priority, False, probed=False, cost=cost, rank=i))
                continue
            res, ks = probe_ranked(cand, req, numeric=numeric, stored=stored.get(cand.name), cost=cost, rank=i)
            if res.cache_keys and not res.from_store:
                self.probe_count += 1
            results.append(res)
            if res.accepted and chosen is None:
                chosen, kernels = res, ks
        results += rejected
        store.save(path, {"request": req.to_dict(with_ordinal=False), "mode": mode}, results)
        return results, chosen, kernels

    def _store_root(self, s: Any) -> Any:
        if self._store_dir is not ...:
            return self._store_dir
        return (s.cache_dir / "decisions") if s.persist_decisions else None

    def check_overrides(self, s: Any = None) -> None:
        """ConfigError for an op in RTCKERN_FORCE_IMPL / RTCKERN_DISABLE_OPS that has no registered candidate, or
        a forced candidate that is not one of its op's. Runs on every slow-path selection (ops register at
        import: a module that registers an op named there must be imported before the first call)."""
        s = s if s is not None else config.settings()
        with self._lock:
            known = {op: [c.name for c in cands] for op, cands in self._candidates.items() if cands}
        later = "; an op that a module of yours registers: import it before the first rtckern call"
        for setting, ops in ((FORCE_SETTING, sorted(s.force_impl)), (DISABLE_SETTING, sorted(s.disabled_ops))):
            unknown = [op for op in ops if op not in known and not (setting == DISABLE_SETTING and op == "all")]
            if unknown:
                extra = " (or all)" if setting == DISABLE_SETTING else ""
                raise ConfigError(f"{setting} names op {unknown[0]!r}, which no registered candidate serves; known "
                                  f"ops: {', '.join(sorted(known)) or '(none: import rtckern.ops)'}{extra}. Fix or "
                                  f"unset {setting}{later}")
        for op, forced in sorted(s.force_impl.items()):
            if forced not in known[op]:
                raise ConfigError(f"{FORCE_SETTING} forces {forced!r} for op {op!r}, which is not one of its "
                                  f"candidates: {', '.join(known[op])}. Fix or unset {FORCE_SETTING}")

    def _override_reasons(self, op: str, cands: tuple[Candidate, ...], s: Any) -> dict[str, Reason]:
        """Candidates the settings take out of the running, each with its reason (ConfigError for an op or
        candidate name the settings name and the registry does not know)."""
        self.check_overrides(s)
        if op in s.disabled_ops or "all" in s.disabled_ops:
            setting = f"{DISABLE_SETTING}={','.join(sorted(s.disabled_ops))}"
            return {c.name: Reason("override", f"rtckern kernels disabled for op {op!r} by {setting}") for c in cands}
        forced = s.force_impl.get(op)
        if forced is None:
            return {}
        return {c.name: Reason("override", f"not tried: {FORCE_SETTING} forces {forced!r} for op {op!r}")
                for c in cands if c.name != forced}


def unsupported_error(req: OpRequest, results: list[ProbeResult], s: Any) -> UnsupportedRequestError:
    reasons = {r.name: [str(x) for x in r.reasons] or ["not probed"] for r in results}
    hint = ""
    forced = s.force_impl.get(req.op)
    if forced:
        hint = (f"{FORCE_SETTING} forces {forced!r} for {req.op!r}, and it cannot serve this request; unset it "
                "to let the registry choose")
    elif not results:
        hint = f"register a Candidate with op={req.op!r} (ops register theirs at `import rtckern.ops`)"
    err = UnsupportedRequestError(req.describe(), reasons, hint=hint)
    err.request = req
    err.results = tuple(results)
    return err


RequestBuilder = Callable[..., OpRequest]


@dataclass(frozen=True)
class LimitProbe:
    """The dimension of an op whose limits a catalogue shows (a head dim, a row length): sample values, each asked
    for with ``--shape shape.format(value)`` on the op's example request; the values some candidate serves are
    the op's limits, as the candidates' own checks decide them (nothing is declared twice)."""

    dim: str
    values: tuple[int, ...]
    shape: str = "{}"


@dataclass(frozen=True)
class BuilderEntry:
    """A request builder registered for an op, with its help for the CLI."""
    op: str
    fn: RequestBuilder
    help: str = ""
    example: str = ""
    limits: LimitProbe | None = None
