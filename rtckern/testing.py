"""Test helpers shared by the test suite and the benchmarks (not used by the library itself).

:class:`HostileRedis` is a fake Redis server on loopback that misbehaves in one chosen way, to check that the
remote tier's whole-call deadline and value cap hold (tests/unit/cache/test_remote.py,
benchmarks/cache_trust.py). :func:`compile_all` and :func:`compile_name_expressions` compile many kernels on
every core (the tests that compile every variant of a family). ``torch_reference`` is the torch plugin's
reference implementations (loaded on first use). :func:`use_fake_libcuda` gives a process without a GPU a fake
driver library, so that rtckern's runtime runs through the real cuda.bindings (tests/unit/runtime, the CPU modes of
benchmarks/first_call.py and op_overhead.py).

Tests import only public names or this module (tests/unit/test_public_imports.py): a helper the tests need from
inside a family belongs here, under a stable name, rather than imported from a private module.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import socket
import threading

HOSTILE_MODES = ("trickle", "blackhole", "huge", "garbage", "no-accept")


class HostileRedis:
    """A listening socket on 127.0.0.1 whose every connection gets one kind of bad treatment:

    - ``trickle``: answers a bulk header announcing 1 MB and then the value, one byte every ``interval_s``,
      forever (each read succeeds in time, so a per-read timeout never fires);
    - ``blackhole``: accepts and reads, never answers;
    - ``huge``: announces a ``huge_bytes`` value (``$500000000``) and streams zeros as fast as the client reads;
    - ``garbage``: answers with an HTTP error line and random bytes (a wrong port, a proxy);
    - ``no-accept``: never accepts; its backlog is filled at start, so new connects get no SYN-ACK and hang.

    Use as a context manager; ``url`` is the redis:// URL that reaches it.
    """

    def __init__(self, mode: str, *, interval_s: float = 0.3, huge_bytes: int = 500_000_000):
        if mode not in HOSTILE_MODES:
            raise ValueError(f"hostile mode {mode!r}: use one of {', '.join(HOSTILE_MODES)}")
        self.mode = mode
        self.interval_s = interval_s
        self.huge_bytes = huge_bytes
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> "HostileRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.mode == "no-accept":
            self._listener.listen(0)
            self._fill_backlog()
            return
        self._listener.listen(64)
        self._spawn(self._accept_loop)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()
        self._listener.close()

    # ---- internals ----
    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"hostile-redis-{self.mode}")
        self._threads.append(t)
        t.start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _fill_backlog(self) -> None:
        # Linux queues backlog+1 finished handshakes; once full, further SYNs are dropped and connect() waits.
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self._keep(s)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self._keep(conn)
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        try:
            self._read_some(conn)
            if self.mode == "trickle":  # every byte of the reply, the header's too, one at a time
                reply = b"$1000000\r\n"
                for i in itertools.count():
                    if self._stop.wait(self.interval_s):
                        break
                    conn.sendall(reply[i:i + 1] if i < len(reply) else b"x")
            elif self.mode == "blackhole":
                while not self._stop.is_set():
                    self._read_some(conn)
            elif self.mode == "huge":
                conn.sendall(b"$%d\r\n" % self.huge_bytes)
                chunk, sent = bytes(1 << 16), 0
                while not self._stop.is_set() and sent < self.huge_bytes:
                    try:
                        sent += conn.send(chunk)
                    except socket.timeout:
                        continue
            elif self.mode == "garbage":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + os.urandom(8192))
                while not self._stop.is_set():
                    self._read_some(conn)
        except OSError:
            pass  # the client gave up and closed: that is the point

    def _read_some(self, conn: socket.socket) -> None:
        try:
            if conn.recv(65536) == b"":
                raise ConnectionError("client closed")
        except socket.timeout:
            pass


# ---- compile many kernels on every core ----
# The every-variant tests compile thousands of kernels. What keeps that short:
# - kernels of one source (same text, defines and options, same target) compile as name expressions of one NVRTC
#   program: the headers are parsed once for the lot, and each kernel still gets its own entry, lowered name and
#   ptxas report, so its spills are its own (a program that fails is compiled again one kernel at a time, to name
#   the failures as a lone compile does);
# - the programs go to one pool of spawned processes (every core, at a lower priority) kept for the process, and
#   the calling process compiles too while it waits: it takes the programs it needs that no worker has started;
# - prefetch() queues a test's kernels ahead (the test session does it at collection for the tests marked
#   `compiles`), so they compile on the spare core while the other tests run;
# - a verdict is kept per kernel, check and compile settings for the process: a kernel two tests check compiles once.
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PROPERTIES = re.compile(r"Function properties for (\S+)\s*\n[^\n]*?(\d+ bytes spill stores, \d+ bytes spill loads)")
# ptxas -v's performance notes (e.g. C7514: wgmma instructions serialized), each naming its function: a kernel the
# no-spills check passes must have none
_PERF_LOSS = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?) in the function '([^']+)'")
_ANY_PERF_LOSS = re.compile(r"(?:\((C\d+)\) )?Potential Performance Loss: ([^\n]*)")  # however a note is worded
# An internal-linkage device symbol (a namespace-scope variable NVRTC emits) is named with the compiling process's
# id, so a binary that holds one differs in every process: the cache and prefill bundles lose their byte identity.
_PROCESS_NAMED = b"_INTERNAL_"
_CHUNK = 16  # kernels per program at most: small enough to balance the cores, large enough to share the parse
_MAX_WORKERS = 32  # an NVRTC compile of a large kernel takes up to ~1 GB
_WORKER_NICE = 10  # the pool yields to the test process (whose tests may time things)
_pool = None  # the ProcessPoolExecutor, made on first use
_workers = max(1, min(_MAX_WORKERS, os.cpu_count() or 1))
_verdicts: dict = {}  # (spec, check) -> None or the failure line
_pending: dict = {}  # (spec, check) -> (future of its chunk's verdicts, the chunk): queued by _submit


def _executor():
    """The process's pool: a spawned worker per core (spawned: NVRTC state is never forked), made on first use."""
    global _pool
    if _pool is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _pool = ProcessPoolExecutor(max_workers=_workers, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_init_worker)
        atexit.register(stop_pool)
    return _pool


def _init_worker() -> None:
    """A pool worker yields to the test process, and ends with it: a worker holds its own queue's write end, so a
    test process killed without its exit handlers would otherwise leave it waiting for work forever."""
    os.nice(_WORKER_NICE)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def stop_pool() -> None:
    """Drop the queued compiles no worker has started, wait for the started ones and stop the workers (after a
    worker died; at exit). A process that prefetched kernels it may not ask for calls it before it ends (the test
    session does, at its finish: after -x or a Ctrl-C): at interpreter exit Python waits for every queued compile
    of a pool before it runs the atexit handlers."""
    global _pool
    pool, _pool = _pool, None
    _pending.clear()
    if pool is not None:
        atexit.unregister(stop_pool)
        pool.shutdown(wait=True, cancel_futures=True)


def _compile_spec(spec, no_spills: bool = False) -> str | None:
    """None when ``spec`` compiles to a binary with a warning-free log, on an NVIDIA target with no symbol named per
    process (and, with no_spills, ptxas reporting no register spills), else what went wrong."""
    import dataclasses

    from .compiler import compiler_for

    verbose = no_spills and not spec.arch.gfx
    if verbose:
        spec = dataclasses.replace(spec, options=tuple(spec.options) + ("--ptxas-options=-v",))
    try:
        ck = compiler_for(spec.arch).compile(spec)
    except Exception as e:  # collected, reported together
        return f"{spec.name_expression}: {str(e)[:300]}"
    if not ck.binary:
        return f"{spec.name_expression}: empty binary"
    if "warning" in (ck.log or "").lower():
        return f"{spec.name_expression}: warnings: {ck.log[:600]}"
    if not spec.arch.gfx and _PROCESS_NAMED in ck.binary:
        return (f"{spec.name_expression} ({spec.arch.sm}): the binary holds an internal-linkage device symbol "
                f"({_PROCESS_NAMED.decode()}...), named per compiling process, so each compile gives other bytes; "
                "make the namespace-scope variable an enumerator or a constexpr function")
    if verbose:
        spilled = [m for m in _SPILLS.finditer(ck.log or "") if int(m.group(1)) or int(m.group(2))]
        if spilled or not _SPILLS.search(ck.log or ""):
            found = spilled[0].group(0) if spilled else "no ptxas resource report in the log"
            return f"{spec.name_expression} ({spec.arch.sm}): {found}"
        loss = _PERF_LOSS.search(ck.log or "") or _ANY_PERF_LOSS.search(ck.log or "")
        if loss:
            return f"{spec.name_expression} ({spec.arch.sm}): ptxas {loss.group(1) or 'note'}: {loss.group(2)}"
    return None


def _program_verdicts(specs, no_spills: bool) -> list[str | None] | None:
    """The verdict on each of ``specs`` (one NVRTC source, defines, options and cubin target) compiled as one
    program: when it compiles to a binary with a warning-free log and no symbol named per process, and every kernel
    has a lowered name (and, with no_spills, its own ptxas report, the only functions that spill or draw a
    performance note being kernels), each kernel's verdict is the one a lone compile gives (None, its spills or its
    note). None otherwise: the lone compiles name the failures."""
    from cuda.bindings import nvrtc

    from .compiler import compiler_for

    spec = specs[0]
    opts = compiler_for(spec.arch).options_for(spec) + (["--ptxas-options=-v"] if no_spills else [])
    name = (spec.source.rsplit("/", 1)[-1] or "kernel.cu").encode()
    err, prog = nvrtc.nvrtcCreateProgram(spec.program_text().encode(), name, 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return None
    try:
        exprs = [s.name_expression.encode() for s in specs]
        for e in exprs:
            nvrtc.nvrtcAddNameExpression(prog, e)
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS or "warning" in log.lower():
            return None
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or not size:
            return None
        cubin = b" " * size
        if nvrtc.nvrtcGetCUBIN(prog, cubin)[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS or _PROCESS_NAMED in cubin:
            return None  # the lone compiles name the kernels whose binaries carry such a symbol
        lowered = []
        for e in exprs:
            err, low = nvrtc.nvrtcGetLoweredName(prog, e)
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or not low:
                return None
            lowered.append(low.decode() if isinstance(low, bytes) else str(low))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if not no_spills:
        return [None] * len(specs)
    spills = {m.group(1): m.group(2) for m in _PROPERTIES.finditer(log)}
    spilled = {f for f, text in spills.items() if any(int(n) for n in _SPILLS.match(text).groups())}
    losses = {m.group(3): f"ptxas {m.group(1)}: {m.group(2)}" for m in _PERF_LOSS.finditer(log)}
    if len(_ANY_PERF_LOSS.findall(log)) != len(_PERF_LOSS.findall(log)):
        return None  # a note not naming its function: the lone compiles tell whose it is
    if not all(low in spills for low in lowered) or not (spilled | set(losses)) <= set(lowered):
        return None  # a kernel without its report, or a device function that spills or has a note: lone compiles tell
    return [f"{s.name_expression} ({s.arch.sm}): {spills[low]}" if low in spilled else
            f"{s.name_expression} ({s.arch.sm}): {losses[low]}" if low in losses else None
            for s, low in zip(specs, lowered)]


def _groupable(spec) -> bool:
    return not spec.arch.gfx and not spec.arch.ptx


def _check_chunk(specs, no_spills: bool) -> list[str | None]:
    """The verdict on each spec of a chunk."""
    if _groupable(specs[0]):
        try:
            verdicts = _program_verdicts(specs, no_spills)
        except Exception:  # anything odd in the shared program: the lone compiles tell what it was
            verdicts = None
        if verdicts is not None:
            return verdicts
    return [_compile_spec(s, no_spills) for s in specs]


def _check_chunk_in_worker(specs, no_spills: bool, current) -> list[str | None]:
    """A pool worker's job: _check_chunk under the caller's settings (include dirs, lineinfo, CUDA_HOME)."""
    import dataclasses

    from . import config

    with config.override(**{f.name: getattr(current, f.name) for f in dataclasses.fields(current)}):
        return _check_chunk(specs, no_spills)


def _chunks(specs: list, workers: int) -> list[list]:
    """Specs of one program (source, inline code, defines, options, cubin target) in chunks of at most _CHUNK,
    smaller for small groups so every core gets work; AMD and PTX targets one at a time. Largest chunks first."""
    groups: dict = {}
    for s in specs:
        key = (s.source, s.code, s.defines, s.options, s.arch) if _groupable(s) else s
        groups.setdefault(key, []).append(s)
    out = []
    for g in groups.values():
        size = max(1, min(_CHUNK, -(-len(g) // (4 * workers))))
        out += [g[i:i + size] for i in range(0, len(g), size)]
    return sorted(out, key=len, reverse=True)


def _check(no_spills: bool) -> tuple:
    """What a verdict depends on besides the spec: the check, and the settings that reach the compile."""
    from . import config

    current = config.settings()
    return no_spills, current.extra_include_dirs, current.lineinfo, current.cuda_home


def _submit(specs, no_spills: bool) -> None:
    """Queue on the pool every spec with neither a verdict nor a queued compile."""
    from . import config

    check = _check(no_spills)
    todo = [s for s in dict.fromkeys(specs) if (s, check) not in _verdicts and (s, check) not in _pending]
    if not todo:
        return
    current = config.settings()
    pool = _executor()
    for chunk in _chunks(todo, _workers):
        fut = pool.submit(_check_chunk_in_worker, chunk, no_spills, current)
        for s in chunk:
            _pending[(s, check)] = (fut, chunk)


def prefetch(specs, no_spills: bool = False) -> None:
    """Start compiling ``specs`` on the pool and return at once: a later compile_all of them takes these verdicts.
    The test session calls it at collection for each test marked ``compiles``, and stop_pool() at its finish
    (tests/conftest.py)."""
    _submit(specs, no_spills)


def compile_all(specs, jobs: int | None = None, no_spills: bool = False) -> list[str]:
    """Compile every spec (no cache) and return the failures (an error or a compiler warning; with no_spills,
    register spills that ptxas reports for NVIDIA targets and its notes of a performance loss, such as wgmma
    instructions serialized), one line each, in spec order. Kernels of one source compile as one NVRTC program (one
    parse of the headers), on the process's pool of every core and in this process; ``jobs=1`` compiles here only. A
    kernel checked before in this process (same spec, check and compile settings), or queued by prefetch(), is not
    compiled again."""
    specs = list(dict.fromkeys(specs))
    check = _check(no_spills)
    if jobs != 1:
        _submit(specs, no_spills)
    queued = list({id(fut): (fut, chunk) for fut, chunk in
                   (_pending[(s, check)] for s in specs if (s, check) in _pending)}.values())
    for fut, chunk in reversed(queued):  # what no worker has started, this process compiles (last queued first)
        if fut.cancel():
            _record(chunk, check, _check_chunk(chunk, no_spills))
    for fut, chunk in queued:
        if not fut.cancelled():
            try:
                verdicts = fut.result()
            except Exception:  # a worker died (out of memory?): start a new pool; the rest compiles here
                stop_pool()
                continue
            _record(chunk, check, verdicts)
    todo = [s for s in specs if (s, check) not in _verdicts]
    for chunk in _chunks(todo, 1):
        _record(chunk, check, _check_chunk(chunk, no_spills))
    return [v for v in (_verdicts[(s, check)] for s in specs) if v]


def _record(chunk, check, verdicts) -> None:
    for s, v in zip(chunk, verdicts):
        _verdicts[(s, check)] = v
        _pending.pop((s, check), None)


def sample_beyond(specs, reference, every: int = 4) -> list:
    """The specs of ``specs`` whose code (source, inline text, kernel, template arguments, defines, options) no
    spec of ``reference`` has, then every ``every``-th of the others: for an arch whose kernels another arch's
    test compiles in full and whose compiles are known to match it, keeping a check of the target's codegen."""
    def code(s):
        return s.source, s.code, s.name, s.template_args, s.defines, s.options

    covered = {code(s) for s in reference}
    shared = [s for s in specs if code(s) in covered]
    return [s for s in specs if code(s) not in covered] + shared[::every]


def name_expression_specs(source: str, exprs, arch: str) -> list:
    """KernelSpecs of ``source`` (a path under kernel_sources/), one per name expression, for ``arch``."""
    from .spec import KernelSpec

    return [KernelSpec(source, e, arch) for e in exprs]


def compile_name_expressions(source: str, exprs, arch: str, jobs: int | None = None) -> list[str]:
    """compile_all of ``source`` (a path under kernel_sources/) for ``arch`` with every name expression in
    ``exprs``; returns the failures."""
    return compile_all(name_expression_specs(source, exprs, arch), jobs)


def kernel_parameters(text: str, kernel: str) -> list[str]:
    """The parameter declarations of `kernel` (a name, namespace allowed) in the kernel source `text`, one string
    each with whitespace collapsed: what the launch-argument tests hold a host launch against. Macros `#define`d in
    `text` (object-like, or function-like as a parameter list written once for several kernels) are expanded in the
    list; `text` is the source as the preprocessor would see it (its conditional branches already chosen, the
    headers that define the macros included)."""
    name = kernel.split("::")[-1]
    m = re.search(r"__global__[^;{]*?\b" + name + r"\(", text, re.S)
    assert m, f"{name} not found in the source"
    depth, end = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    params = _expand_macros(text[m.end():end - 1], _macro_definitions(text))
    return [" ".join(p.split()) for p in params.split(",")]


def _macro_definitions(text: str) -> dict[str, list[tuple[list[str] | None, str]]]:
    """name -> the distinct (parameter names, or None for an object-like macro; body) of every #define in `text`."""
    defs: dict[str, list[tuple[list[str] | None, str]]] = {}
    for d in re.finditer(r"^[ \t]*#define[ \t]+(\w+)(\(([^)]*)\))?((?:\\\n|[^\n])*)", text, re.M):
        args = [a.strip() for a in d.group(3).split(",")] if d.group(2) else None
        new = (args, " ".join(d.group(4).replace("\\\n", " ").split()))
        if new not in defs.setdefault(d.group(1), []):
            defs[d.group(1)].append(new)
    return defs


def _expand_macros(text: str, defs: dict[str, list[tuple[list[str] | None, str]]]) -> str:
    """`text` with the macros of `defs` expanded; a macro it uses that `defs` holds two different definitions of
    (both branches of an #if left in the source) raises."""
    if not defs:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, defs)) + r")\b(?:\(([^()]*)\))?")

    def one(m: re.Match) -> str:
        if len(defs[m.group(1)]) > 1:
            raise AssertionError(f"macro {m.group(1)} defined twice differently: choose the source's conditional "
                                 "branches before reading its kernel parameters")
        args, body = defs[m.group(1)][0]
        if args is None:  # object-like: what follows it (a parenthesis, say) is not its to take
            return body + m.group()[len(m.group(1)):]
        if m.group(2) is None:  # a function-like macro's name without arguments is left alone
            return m.group()
        values = [v.strip() for v in m.group(2).split(",")]
        return re.sub(r"\b\w+\b", lambda w: values[args.index(w.group())] if w.group() in args else w.group(), body)

    for _ in range(16):  # nested macros: until nothing changes
        out = pattern.sub(one, text)
        if out == text:
            return out
        text = out
    raise AssertionError("macro expansion did not settle")


def check_launch_args(params: list[str], args: tuple, what: str) -> None:
    """Raise AssertionError unless `args` (a launch's arguments) match `params` (kernel_parameters) one for one:
    128 bytes for a tensor map, an int for a pointer, numpy int64 for long long, numpy float32 for float."""
    import numpy as np

    assert len(params) == len(args), f"{what}: {len(args)} arguments for {len(params)} parameters"
    for p, a in zip(params, args):
        if "tensor_map" in p:  # a CUtensorMap by value
            assert type(a) is bytes and len(a) == 128, (what, p, a)
        elif "*" in p:
            assert type(a) is int, (what, p, a)
        elif p.startswith("long long"):
            assert type(a) is np.int64, (what, p, a)
        elif p.startswith("float"):
            assert type(a) is np.float32, (what, p, a)
        else:
            raise AssertionError(f"{what}: parameter {p!r} of an unexpected type")


def norms_variants(arch: str):
    """Every norms kernel spec the every-variant compile test covers on `arch` (forward and backward of every
    kind, four dtype combinations, seven widths, plain and with every flag), in a stable order with repeats; the
    test and tools/cubin_hashes.py both enumerate through here."""
    from .arch import Arch
    from .device import DeviceInfo
    from .ops._norms import configs, geometry

    a, dev = Arch.parse(arch), DeviceInfo.for_arch(arch)
    combos = [("bf16", "bf16", "bf16"), ("fp16", "fp32", "fp16"), ("fp32", "fp32", "fp32"), ("bf16", "fp32", "fp32")]
    for layer in (False, True):
        for x, w, y in combos:
            for n in (1, 7, 1000, 4096, 5121, 65536, 262144):
                vec = geometry.pick_vec(n, (geometry.ITEMSIZE[x],), (16,))
                for extra in ({}, {"zero_centered": True, "residual": True, "save_stats": True}):
                    fp = geometry.FwdProblem(layer=layer, n=n, x=x, y=y, w=w, bias=layer, vec=vec, **extra)
                    bp = geometry.BwdProblem(layer=layer, n=n, x=x, dy=y, dx=x, w=w, weight_grad=True, bias_grad=layer,
                                             vec=vec, zero_centered=bool(extra), dresidual=bool(extra))
                    for kind in ("rows", "cluster", "l2", "l2c", "stage", "coop"):
                        if kind in ("cluster", "l2c") and a.cc < (9, 0):
                            continue
                        c = configs.fwd_config(fp, kind, dev) if kind not in geometry.BWD_ONLY_KINDS else None
                        if c is not None:
                            yield geometry.fwd_spec(fp, kind, c, a)
                        c = configs.bwd_config(bp, kind, dev)
                        if c is not None:
                            yield from geometry.bwd_specs(bp, kind, c, a)


def grouped_gemm_variants(arch: str):
    """Every grouped GEMM kernel spec the every-variant compile test covers on `arch`: the specs every candidate of
    grouped_gemm (bf16 / fp16 in, every output dtype, both layouts, aligned or not) and grouped_gemm_fp8 (every output
    dtype) serves there, in both modes, for rows per group that take each tile of the rules (and for many groups,
    whose tile prefix leaves the ring fewer stages (fp8) or no room for the store boxes (bf16), and for fp8 output rows
    that are not 16-byte multiples: both store from registers); built through the registry's request builders (as
    `rtckern explain` builds them), in a stable order with repeats. Empty where no candidate serves (sm_75); the test
    and tools/cubin_hashes.py both enumerate through here."""
    with without_tuning_tables():  # the rules' tiles (tests/unit/ops/test_grouped_tune.py compiles the rows' tiles)
        specs = list(_grouped_rule_specs(arch))
    yield from specs


def _grouped_rule_specs(arch: str):
    from .device import DeviceInfo
    from .registry import build_request, candidates
    from .registry.candidate import arch_reason

    dev = DeviceInfo.for_arch(arch, sm_count=132)
    reqs = [build_request("grouped_gemm", shape=(8, rows, 4096, 7168), dtype=dt, device=dev,
                          options={"mode": mode, "out": out, "trans_b": tb, "aligned": al})
            for mode in ("contiguous", "masked") for rows in (16, 128, 512) for dt in ("bf16", "fp16")
            for out in ("bf16", "fp16", "fp32") for tb in ("1", "0") for al in ("1", "0")]
    # 1024 groups: a tile prefix that leaves the 128 x 256 tile's ring no room for the TMA store's boxes (outputs from
    # registers; up to 447 groups the boxes fit)
    reqs += [build_request("grouped_gemm", shape=(1024, 512, 4096, 7168), dtype="bf16", device=dev,
                           options={"mode": mode, "trans_b": tb})
             for mode in ("contiguous", "masked") for tb in ("1", "0")]
    reqs += [build_request("grouped_gemm_fp8", shape=(groups, rows, n, 7168), dtype=None, device=dev,
                           options={"mode": mode, "out": out})
             for mode in ("contiguous", "masked")
             for groups, rows, n in ((8, 16, 4096), (8, 128, 4096), (8, 512, 4096), (1024, 512, 4096), (8, 512, 4100))
             for out in ("bf16", "fp16", "fp32")]
    for req in reqs:
        for c in candidates(req.op):
            if arch_reason(c, req) is None and c.supports(req) is None:
                yield from c.kernel_specs(req)


def grouped_tile_bound(mode: str, groups: int, rows: int, bm: int) -> int:
    """The upper bound of the m-tiles of any group sizes that sizes the grouped GEMMs' grids (rows: total_m in
    contiguous mode, the capacity in masked mode)."""
    from .ops._common_grouped import m_tiles_bound

    return m_tiles_bound(mode, groups, rows, bm)


def dense_gemm_identity_specs():
    """Dense GEMM kernels of the sources the grouped GEMMs share (gemm_sm90.cuh, gemm_sm80.cuh, gemm_fp8_sm90.cuh)
    whose binaries tests/unit/ops/dense_gemm_cubins.json records from before RTK_GEMM_GROUPED: the wgmma tiles the
    grouped rule uses in both layouts with and without an epilogue, ping-pong, split-K through a workspace and in a
    cluster; the mma.sync tiles likewise (aligned and not, sm_80 and sm_90 targets); the fp8 kernel's two rule tiles
    for both scale kinds."""
    import dataclasses

    from .arch import Arch
    from .ops._fp8 import geometry as f8
    from .ops._gemm import geometry as g

    a = Arch.parse("sm_90a")
    # rows of c that are not 16-byte multiples: the wgmma kernel's outputs stored from registers, its form from
    # before RTK_GEMM_TMA_STORE existed (tools/cubin_hashes.py compares the rest)
    plain = g.GemmProblem(1, 4096, 4100, 4096, "bf16", "bf16", True)
    epi = g.GemmProblem(2, 4096, 4096, 4096, "fp16", "fp32", False, True, "silu", True)
    cfgs = (g.Sm90Config(64, 128, 8, 1), g.Sm90Config(128, 128, 6, 2), g.Sm90Config(128, 256, 4, 2),
            g.Sm90Config(128, 128, 4, 2, pingpong=True), g.Sm90Config(128, 128, 6, 2, splits=3),
            g.Sm90Config(128, 64, 8, 2, splits=2, cluster=True))
    specs = [g.kernel_specs(p, c, a)[0] for p in (plain, epi) for c in cfgs]
    mma = (g.Sm80Config(64, 64, 64, 32, 32, 4), g.Sm80Config(128, 128, 32, 64, 64, 4),
           g.Sm80Config(64, 64, 64, 32, 32, 3, splits=2), g.Sm80Config(16, 128, 64, 16, 32, 4, splits=4, cluster=True))
    for arch in ("sm_80", "sm_90"):
        for p in (plain, epi, dataclasses.replace(plain, aligned=False)):
            for c in mma:
                if not (c.cluster and arch == "sm_80"):
                    specs.append(g.kernel_specs(p, c, Arch.parse(arch))[0])
    # stored from registers (rows of c that are not 16-byte multiples): the fp8 kernel's form from before
    # RTK_FP8_TMA_STORE existed too
    specs += [f8.sm90_spec(f8.Fp8Problem(4096, 4100, 4096, sc, "bf16", bias), c, a)
              for sc in ("tensor", "block") for bias in ("none", "fp32")
              for c in (f8.Sm90Fp8Config(128, 128, 6, 2), f8.Sm90Fp8Config(64, 128, 8, 1),
                        f8.Sm90Fp8Config(128, 256, 4, 2))]
    return specs


@contextlib.contextmanager
def attention_backward_unsplit():
    """The sm90a attention backward without its GQA head split (backward_configs.head_splits answering 1: each block
    walks its whole group, the varlen kernel's code path), memoized call plans cleared on the way in and out. For
    the GPU tests that compare with the unsplit kernel and the benchmark's rtckern_unsplit series."""
    import rtckern
    from rtckern.ops._attention import backward_configs

    real = backward_configs.head_splits
    backward_configs.head_splits = lambda *a, **kw: 1
    rtckern.clear_caches()
    try:
        yield
    finally:
        backward_configs.head_splits = real
        rtckern.clear_caches()


def kvcache_kernel_exprs(head_dims) -> tuple[str, list[str]]:
    """(source, name expressions) of every attention_with_kvcache kernel variant: for bf16 and fp16 and each head
    dim, the attention kernel at its default tile (causal and not), the split merge, the append and the gather."""
    from .ops._attention import configs
    from .ops._attention import kvcache_candidates as kc

    exprs = []
    for dtype in ("bf16", "fp16"):
        t = configs.DTYPES[dtype]
        for hd in head_dims:
            tile = kc.DEFAULT_TILES[hd]
            for causal in (False, True):
                args = ", ".join(str(a).lower() if isinstance(a, bool) else str(a)
                                 for a in tile.template_args(dtype, hd, causal))
                exprs.append(f"{kc.KERNEL}<{args}>")
            exprs.append(f"{kc.COMBINE_KERNEL}<{t}, {hd}, {kc.COMBINE_THREADS}, {kc.MAX_SPLITS}>")
            exprs.append(f"{kc.APPEND_KERNEL}<{t}, {hd}>")
            exprs.append(f"{kc.GATHER_KERNEL}<{t}, {hd}>")
    return kc.SOURCE, exprs


def kvcache_fp8_specs(head_dims, arch: str) -> list:
    """The kernels of an attention_with_kvcache request over float8_e4m3fn caches on a described `arch` (sm_89+):
    for bf16 and fp16 q and each head dim, the tensor-core candidate's four specs (the attention kernel's RTK_KV_FP8
    form, causal and not, the split merge, the fp8 append and the fp8 gather), as the op would compile them."""
    from .device import DeviceInfo
    from .ops._attention import kvcache_candidates as kc

    dev, cand = DeviceInfo.for_arch(arch), kc.Sm80Decode()
    specs = []
    for dtype in ("bf16", "fp16"):
        for hd in head_dims:
            for causal in (False, True):
                specs += cand.kernel_specs(kc.request(dtype, hd, causal, dev, kc.FP8_CACHE))
    return list(dict.fromkeys(specs))


def kvcache_simt_kernel_exprs(head_dims) -> tuple[str, list[str]]:
    """(source, name expressions) of the portable attention_with_kvcache kernel (decode_simt.cuh, which includes
    the merge, append and gather): bf16 and fp16, each head dim, causal and not."""
    from .ops._attention import configs
    from .ops._attention import kvcache_candidates as kc

    exprs = [f"{kc.SIMT_KERNEL}<{configs.DTYPES[dt]}, {hd}, {str(c).lower()}>" for dt in ("bf16", "fp16")
             for hd in head_dims for c in (False, True)]
    return kc.SIMT_SOURCE, exprs


def kvcache_split_choice(device=None, fp8: bool = False, **kw) -> int:
    """attention_with_kvcache's split-KV count for (batch, heads_kv, tiles, capacity, sm_count[, per_sm]); with
    `device` instead of sm_count and per_sm, the op's choice on that device (its SM count and class); fp8: for an e4m3
    cache."""
    from .ops._attention import kvcache_candidates as kc

    if device is not None:
        if "sm_count" in kw or "per_sm" in kw:
            raise TypeError("kvcache_split_choice: with device=, the device gives the SM count and blocks per SM")
        return kc.device_splits(device, fp8, kw["batch"], kw["heads_kv"], kw["tiles"], kw["capacity"])
    if fp8:
        kw.setdefault("per_sm", 2)
    return kc.choose_splits(**kw)


# ---- a fake libcuda ----------------------------------------------------------------------------------------------
FAKE_DEVICE = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
               "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
               "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
               "MAX_THREADS_PER_BLOCK": 1024, "WARP_SIZE": 32, "COOPERATIVE_LAUNCH": 1}
FAKE_FUNCTION = {"NUM_REGS": 40, "SHARED_SIZE_BYTES": 1024, "LOCAL_SIZE_BYTES": 0, "MAX_THREADS_PER_BLOCK": 1024,
                 "BINARY_VERSION": 90}
# One H200-like device. cuda.bindings finds each entry point through cuGetProcAddress (here: dlsym of the same name),
# the native launcher through dlsym. The current context is tracked: calls that need the device's context fail
# without it. An image starting with "BAD" is refused (CUDA_ERROR_INVALID_IMAGE); counters say what was called.
_FAKE_LIBCUDA = r"""
#include <dlfcn.h>
#include <string.h>
#include <stddef.h>
int rtk_fake_loads, rtk_fake_launches, rtk_fake_setattrs;
char rtk_fake_last_name[256];
static void* current = 0;  /* every name the fake exports is cu* or rtk_fake_*: nothing else to interpose */
int rtk_fake_procaddrs = 0;  /* entry points asked for: cuda.bindings.driver asks for all on its first call */
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
/* NVRTC, where a libcuda is loaded, calls cuInit and then asks for a private table: none here */
int cuGetExportTable(const void** table, const void* id) { *table = 0; return 801; }
int cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status) {
  ++rtk_fake_procaddrs;
  void* p = dlsym(RTLD_DEFAULT, sym);
  if (status) *status = p ? 0 : 1;
  *pfn = p;
  return p ? 0 : 500;
}
int cuGetProcAddress(const char* sym, void** pfn, int ver, unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, 0);
}
int cuGetErrorName(int e, const char** s) {
  *s = e == 200 ? "CUDA_ERROR_INVALID_IMAGE" : "CUDA_ERROR_UNKNOWN";
  return 0;
}
int cuGetErrorString(int e, const char** s) { *s = "fake libcuda"; return 0; }
int cuDeviceGetCount(int* n) { *n = 1; return 0; }
int cuDeviceGet(int* dev, int ordinal) { if (ordinal != 0) return 101; *dev = 0; return 0; }
int cuDeviceGetAttribute(int* pi, int a, int dev) {
  switch (a) {
%(device)s
  }
  return 1;
}
int cuDeviceGetName(char* name, int len, int dev) { strncpy(name, "NVIDIA H200", len); return 0; }
int cuDeviceTotalMem(size_t* b, int dev) { *b = (size_t)143771 << 20; return 0; }
int cuDeviceTotalMem_v2(size_t* b, int dev) { return cuDeviceTotalMem(b, dev); }
int cuDevicePrimaryCtxRetain(void** c, int dev) { *c = (void*)0xC0; return 0; }
int cuCtxGetDevice(int* dev) { *dev = 0; return 0; }
int cuCtxGetCurrent(void** c) { *c = current; return 0; }
int cuCtxSetCurrent(void* c) { current = c; return 0; }
int cuCtxPushCurrent(void* c) { current = c; return 0; }
int cuCtxPushCurrent_v2(void* c) { current = c; return 0; }
int cuCtxPopCurrent(void** c) { *c = current; current = 0; return 0; }
int cuCtxPopCurrent_v2(void** c) { return cuCtxPopCurrent(c); }
int cuLibraryLoadData(void** lib, const void* code, void* jo, void** jv, unsigned nj, void* lo, void** lv,
                      unsigned nl) {
  ++rtk_fake_loads;
  if (memcmp(code, "BAD", 3) == 0) return 200;
  *lib = (void*)0x1000;
  return 0;
}
int cuLibraryUnload(void* lib) { return 0; }
int cuLibraryGetKernel(void** k, void* lib, const char* name) {
  strncpy(rtk_fake_last_name, name, 255);
  *k = (void*)0x2000;
  return 0;
}
int cuKernelGetFunction(void** f, void* k) { if (current != (void*)0xC0) return 201; *f = (void*)0x3000; return 0; }
int cuKernelGetAttribute(int* pi, int a, void* k, int dev) {
  switch (a) {
%(function)s
  }
  return 1;
}
int cuKernelSetAttribute(int a, int v, void* k, int dev) { ++rtk_fake_setattrs; return 0; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void* f, int block, size_t smem) {
  if (current != (void*)0xC0) return 201;
  *n = 3;
  return 0;
}
int cuOccupancyMaxPotentialBlockSize(int* g, int* b, void* f, void* cb, size_t smem, int lim) {
  *g = 264; *b = 512;
  return 0;
}
int cuTensorMapEncodeTiled(void* map, int t, unsigned rank, void* addr, const void* dims, const void* strides,
                           const void* box, const void* es, int il, int sw, int l2, int oob) {
  memset(map, 0, 128);
  return 0;
}
int cuTensorMapReplaceAddress(void* map, void* addr) { memcpy(map, &addr, sizeof addr); return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem,
                   void* s, void** p, void** e) {
  if (f != (void*)0x3000 || current != (void*)0xC0) return 400;
  ++rtk_fake_launches;
  return 0;
}
"""


def fake_libcuda(directory: str | None = None) -> str:
    """The path of the fake libcuda.so.1 (see _FAKE_LIBCUDA), built with the C compiler once per source under
    `directory` (default: the temp dir). RuntimeError without a C compiler."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    from cuda.bindings import driver as d

    def cases(enum, prefix, values):
        return "\n".join(f"    case {int(getattr(enum, prefix + k))}: *pi = {v}; return 0;" for k, v in values.items())
    source = _FAKE_LIBCUDA % {"device": cases(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_", FAKE_DEVICE),
                              "function": cases(d.CUfunction_attribute, "CU_FUNC_ATTRIBUTE_", FAKE_FUNCTION)}
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH to build the fake libcuda")
    base = os.path.join(directory or tempfile.gettempdir(), f"rtckern-fake-libcuda-{os.getuid()}",
                        hashlib.sha256(source.encode()).hexdigest()[:16])
    path = os.path.join(base, "libcuda.so.1")
    if not os.path.exists(path):
        os.makedirs(base, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            src, out = os.path.join(tmp, "fake.c"), os.path.join(tmp, "libcuda.so.1")
            with open(src, "w") as f:
                f.write(source)
            subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out, src, "-ldl"], check=True,
                           capture_output=True)
            os.replace(out, path)
    return path


def use_fake_libcuda(directory: str | None = None) -> str:
    """Load the fake libcuda into this process, before anything loads a real one: cuda.bindings (through
    cuda-pathfinder, which takes a libcuda.so.1 that is loaded already) and the native launcher then call it. For a
    process of its own (a test's subprocess, a CPU benchmark): it cannot be undone. Returns its path."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        pass
    else:
        raise RuntimeError("a libcuda.so.1 is loaded in this process already: the fake must come first")
    path = fake_libcuda(directory)
    ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    return path


# ---- names the tests use from inside a family or plugin (one place to change when files move) ----------------
def torch_op_python_path(name: str):
    """The Python implementation behind torch.ops.rtckern.<name> for a plain eager call without gradients, taking
    every argument (defaults included): what the native front of the torch ops records (rtckern.plugins
    ._torch_native), to compare its replays against. It runs the rtckern.ops functions' Python paths
    (without_direct_front)."""
    from .plugins import _torch_lib

    op = _torch_lib.KERNEL_OPS.get(name)
    fn = op.fn if op is not None else _torch_lib.COMPOSITE_DIRECT[name]

    def python_path(*args):
        with without_direct_front():
            return fn(*args)
    return python_path


def direct_call(function: str, *op_args):
    """What the torch plugin's native front gives an rtckern.ops function served from C++ (the norms, softmax and its
    kin, the fp8 ops: rtckern.ops._common.DIRECT_SLOTS; by its slot's name) for its torch op's arguments (every one, in the op's order):
    the op's results replayed (or, for a signature not learned yet, called through the dispatcher), or None where
    the function would take its Python path. None where the front is not loaded. For tests."""
    from .ops._common import DIRECT_SLOTS
    from .runtime.native import direct_front

    call = direct_front.call
    return None if call is None else call(DIRECT_SLOTS.index(function), *op_args)


@contextlib.contextmanager
def without_direct_front():
    """Inside, the rtckern.ops functions that the torch plugin's native front serves from C++ where it is loaded
    (the norms, softmax and its kin, the fp8 ops: rtckern.ops._common.DIRECT_SLOTS) take their Python paths: to
    compare the two. Process-wide while inside (for tests)."""
    from .runtime.native import direct_front

    saved, direct_front.call = direct_front.call, None
    try:
        yield
    finally:
        direct_front.call = saved


@contextlib.contextmanager
def python_autograd():
    """Inside, this thread's torch.ops.rtckern calls needing a gradient take the ops' Python autograd.Function rather
    than the native front's C++ autograd nodes (rtckern.plugins._torch_native): to compare the two. Replays of calls
    without a gradient stay. No-op where the front is not active."""
    from .plugins import _torch_native

    with _torch_native.python_autograd():
        yield


def __getattr__(name: str):
    """``torch_reference``: the torch plugin's reference implementations (plain torch, the oracle the plugin's
    tests compare against); loaded on first use, since it imports torch."""
    if name == "torch_reference":
        from .plugins import _torch_ref

        return _torch_ref
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def without_tuning_tables():
    """Lookups inside see no tuning table, neither the shipped ones (rtckern/tuning_tables/) nor the user's (an empty
    directory): every op takes its rule, as on a device no row serves. For tests and tools that enumerate what the
    rules choose, independent of the rows shipped today."""
    import tempfile
    from pathlib import Path

    from . import config, tuning

    shipped = tuning.SHIPPED_DIR
    with tempfile.TemporaryDirectory() as d:
        tuning.SHIPPED_DIR = Path(d) / "shipped"
        try:
            with config.override(tuning_table_dir=Path(d) / "tuning"):
                yield
        finally:
            tuning.SHIPPED_DIR = shipped
