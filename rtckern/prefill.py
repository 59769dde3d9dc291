"""The built-in kernel set and compiling it for a list of archs without a GPU.

Kernel providers (each op family, and the core itself) register a function that, given the target archs,
returns the ``KernelSpec``s to build. Prefill compiles them through the manager's caches, in parallel
processes, deterministically: the same arch list and toolchain give the same keys and bytes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Sequence

from .arch import DEFAULT_ARCH_LIST, Arch, ArchFilter, parse_arch_list
from .dtypes import FLOATS, ctype
from .registry.providers import kernel_providers, register_kernel_provider
from .spec import KernelSpec

DEFAULT_ARCHS = DEFAULT_ARCH_LIST  # the built-in default; RTCKERN_ARCH_LIST replaces it (default_arch_list())
WORKER_STOP_S = 1.0  # an interrupted prefill waits this long for a terminated worker before killing it

# ``register_provider(name, fn)``, ``fn(archs) -> specs``: the registry keeps kernel providers (op families, a layer
# below prefill, register theirs at import); the name stays here for callers of rtckern.prefill.
register_provider = register_kernel_provider


def _core_specs(archs: Sequence[Arch]) -> Iterable[KernelSpec]:
    """The core service's own kernels: tests, benchmarks, smoke set."""
    for arch in ArchFilter.of(min_arch="7.5", vendors=("nvidia", "amd")).targets(archs):
        for t in map(ctype, FLOATS):
            yield KernelSpec("core/axpy.cuh", "axpy", arch, template_args=(t,), op="core")
        for name in ("noop0", "noop8", "coop_sum", "smem_reverse", "cluster_rank"):
            yield KernelSpec("core/axpy.cuh", name, arch, op="core")


register_provider("core", _core_specs)


def _preset_specs(archs: Sequence[Arch]) -> Iterable[KernelSpec]:
    """Every op family's kernels for the shipped presets ``common`` (norms, softmax, attention at hidden sizes
    2048-8192, head dims 64/128, bf16/fp16) and ``llama-3.1-8b`` (adds its GEMM shapes and the KV-cache decode
    kernels): for each request and device arch, the kernels of the candidate the registry would choose first."""
    from .fleet import load_preset
    from .fleet.plan import plan

    load_builtin_providers()  # the registry needs the op families' request builders
    for planned in plan(load_preset("common") + load_preset("llama-3.1-8b"), archs):
        if planned.chain:
            yield from planned.chain[0].specs


register_provider("ops", _preset_specs)


def load_builtin_providers() -> None:
    """Import op families so their providers register (an op family that fails to import is skipped)."""
    try:
        import rtckern.ops  # noqa: F401
    except ImportError:
        pass


def builtin_specs(archs: Sequence[Arch], families: Sequence[str] | None = None) -> list[KernelSpec]:
    load_builtin_providers()
    providers = kernel_providers()
    unknown = sorted(set(families or ()) - set(providers))
    if unknown:
        from .errors import OptionError

        raise OptionError(f"unknown kernel family {', '.join(map(repr, unknown))}; the families: "
                          f"{', '.join(sorted(providers))}")
    out: dict[KernelSpec, None] = {}
    for name in sorted(providers):
        if families and name not in families:
            continue
        for spec in providers[name](archs):
            targets = [spec.arch]
            if spec.arch.ptx:  # "+PTX": a cubin and PTX
                targets = [dataclasses.replace(spec.arch, ptx=False), spec.arch]
            for t in targets:
                out.setdefault(dataclasses.replace(spec, arch=t), None)
    return sorted(out, key=spec_order)


def spec_order(s: KernelSpec) -> tuple:
    """A total, deterministic order of specs (arch, source, kernel, defines, options, inline code)."""
    return (s.arch.sort_key(), s.source, s.name_expression, s.defines, s.options, s.code)


@dataclasses.dataclass
class PrefillResult:
    spec: KernelSpec
    key: str
    status: str  # "compiled", "cached" or "failed"
    ms: float
    error: str = ""


_managers: dict[tuple, object] = {}


def _manager_for(cache_dir: str | None):
    """One manager per cache dir per process (and per settings object): a worker compiling hundreds of kernels
    opens its cache (and its remote connection) once."""
    from .config import settings
    from .manager import KernelManager, get_manager

    if not cache_dir:
        return get_manager()
    k = (str(cache_dir), id(settings()))
    m = _managers.get(k)
    if m is None:
        m = _managers[k] = KernelManager(cache_dir)
    return m


def _compile_one(spec: KernelSpec, cache_dir: str | None) -> PrefillResult:
    m = _manager_for(cache_dir)
    t0 = time.perf_counter()
    try:
        key = m.key(spec)
        ck, tier = m.lookup(spec)
        if ck is not None:
            if cache_dir and tier in ("layer", "memory"):  # prefill --out DIR: DIR must hold every kernel, those a
                _copy_from_layer(m, key, ck)  # read-only layer serves too (a node's own cache needs no copy)
            return PrefillResult(spec, key, "cached", (time.perf_counter() - t0) * 1e3)
        before = m.stats.compiles
        m.compile(spec)
        # Another process may have compiled it while we waited for the lock: count what this one did.
        status = "compiled" if m.stats.compiles > before else "cached"
        return PrefillResult(spec, key, status, (time.perf_counter() - t0) * 1e3)
    except Exception as e:  # one failure never stops the others
        return PrefillResult(spec, "", "failed", (time.perf_counter() - t0) * 1e3, f"{type(e).__name__}: {e}")


def _copy_from_layer(m, key: str, ck) -> None:
    """Put the read-only layers' entry for ``key`` that holds ``ck`` (the one served; with its metadata) into the
    manager's disk cache, if that lacks it."""
    if m.disk is None or m.disk.get_packed(key) is not None:
        return
    from .cache import unpack

    for layer in m.layers:
        data = layer.get_packed(key)  # (digest-checked)
        if data is not None and unpack(data, key) == ck:
            m.disk.put_packed(key, data, layer.meta(key, data)[0] or None)
            return


def _worker(args):
    spec, cache_dir = args
    return _compile_one(spec, cache_dir)


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C (SIGINT to the terminal's whole process group) to the parent, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(ex: ProcessPoolExecutor) -> None:
    """Cancel the queued compiles and end the running ones now (an interrupt): a compile in a worker is one NVRTC
    call that would otherwise run on for seconds. Entries are written atomically and lock files are flocks the
    kernel releases, so a killed worker leaves at most a temp file that `rtckern cache verify` or `prune` removes."""
    # Taken before shutdown(), which forgets them (Python < 3.14 has no public way to reach the workers).
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(WORKER_STOP_S)
        if p.is_alive():
            p.kill()


def prefill(specs: Sequence[KernelSpec], *, jobs: int = 1, cache_dir: str | None = None,
            progress: Callable[[PrefillResult], None] | None = None) -> list[PrefillResult]:
    """Compile (or find) every spec, over ``jobs`` processes; results in the order of ``specs``. A
    KeyboardInterrupt cancels what is queued, stops the workers and propagates; what was compiled stays cached."""
    results: list[PrefillResult] = []
    if jobs <= 1 or len(specs) <= 1:
        for s in specs:
            r = _compile_one(s, cache_dir)
            results.append(r)
            if progress:
                progress(r)
    else:
        ctx = None
        try:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")  # no forked CUDA/NVRTC state
        except ValueError:
            pass
        ex = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_ignore_sigint)
        try:
            futs = {ex.submit(_worker, (s, cache_dir)): s for s in specs}
            for f in as_completed(futs):
                try:
                    r = f.result()
                except BrokenProcessPool as e:  # a worker died (OOM killer, a crashing compiler): the specs it and
                    # the pool still held fail, named, and the others' results stand
                    r = PrefillResult(futs[f], "", "failed", 0.0, f"the compile worker died ({e}); run prefill "
                                      "again (what was compiled is cached), or with --jobs 1 to see which kernel")
                results.append(r)
                if progress:
                    progress(r)
        except BaseException:
            _stop_workers(ex)
            raise
        ex.shutdown(wait=True)
    order = {s: i for i, s in enumerate(specs)}
    results.sort(key=lambda r: order[r.spec])
    return results


def default_jobs() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def unsupported_archs(archs: Sequence[Arch]) -> dict[str, str]:
    """Archs in the list that no installed compiler can target, with the reason (reported as failures)."""
    from .compiler import compiler_for
    from .errors import ArchError

    out = {}
    for a in archs:
        try:
            c = compiler_for(a)
            if a.gfx:
                c.check_target(a.gfx)  # raises for a target this hiprtc does not know (e.g. gfx942 on ROCm 5.2)
            elif a.number not in c.supported_archs():
                from .arch import nvrtc_unsupported_message

                out[str(a)] = nvrtc_unsupported_message(a, c.supported_archs(), c.version())
        except (ArchError, ImportError, Exception) as e:  # e.g. no hiprtc installed for a gfx target
            out[str(a)] = f"{type(e).__name__}: {e}"
    return out


def summarize(results: Sequence[PrefillResult], seconds: float, arch_failures: dict[str, str] | None = None) -> dict:
    by = {"compiled": 0, "cached": 0, "failed": 0}
    for r in results:
        by[r.status] += 1
    arch_failures = arch_failures or {}
    by["failed"] += len(arch_failures)
    per_arch: dict[str, dict[str, int]] = {}
    for r in results:
        a = per_arch.setdefault(r.spec.arch.sm + ("+ptx" if r.spec.arch.ptx else ""),
                                {"compiled": 0, "cached": 0, "failed": 0})
        a[r.status] += 1
    return {
        "total": len(results), **by, "seconds": round(seconds, 3), "per_arch": per_arch,
        "compile_ms": round(sum(r.ms for r in results if r.status == "compiled"), 1),
        "failures": [{"kernel": f"every kernel for {a}", "error": e} for a, e in arch_failures.items()]
        + [{"kernel": r.spec.describe(), "error": r.error} for r in results if r.status == "failed"],
    }


def default_arch_list() -> str:
    """The arch list used when none is given: RTCKERN_ARCH_LIST, else DEFAULT_ARCHS."""
    from .config import settings

    return settings().arch_list or DEFAULT_ARCHS


def parse_archs(text: str | None) -> list[Arch]:
    """An arch list; None means the default list (an empty string is an error, not the default)."""
    return parse_arch_list(default_arch_list() if text is None else text)
