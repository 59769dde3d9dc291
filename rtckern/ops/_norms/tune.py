"""The norm tuner behind `rtckern tune rms_norm|layer_norm|rms_norm_backward|layer_norm_backward --shapes N,...`
(and `benchmarks/norms.py sweep`): times every candidate config of every kernel kind for one (norm, direction,
dtype, N) on the live GPU, each checked against float64 before it may win, and writes

    norm_fwd / norm_bwd   the fastest config of each kind, keyed (kind, norm, dtype, n, vec)
    norm_kind             the fastest kind, keyed (dir, norm, dtype, n)

The problem timed is the tables' (what the shipped rows were measured on): 2^27 elements (rows = 2^27 / N), the
weight in x's dtype, a bias for LayerNorm, no residual, saved statistics or zero-centering; dweight (and dbias for
LayerNorm) in the backward. The rows of `--shapes` are ignored (only N keys the tables).

Candidate space (`sweep_configs`): per kind, the configs the sweeps that made the shipped tables timed (below),
plus the config the tables (or the heuristic) give each kind now, so a re-tune re-times what ships.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from rtckern import tuning
from rtckern.errors import RtckernError

from . import candidates as cands
from . import configs, geometry, launch

log = logging.getLogger(__name__)

TUNE_ELEMENTS = 1 << 27  # per problem: far larger than any L2 (60 MB on H200)
EPS = 1e-5
TOL = MappingProxyType({"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.5e-2})  # largest relative error of dx / y / dweight vs float64
SWEPT_ROW_LIMIT = 65536  # the longest N of the benchmark's sweep; coop may win a kind choice only past it
SMEM_PER_SM = 228 * 1024  # H100 / H200; 1 KB of it is reserved per block

OPS = MappingProxyType({"rms_norm": ("fwd", "rms"), "layer_norm": ("fwd", "layer"),
       "rms_norm_backward": ("bwd", "rms"), "layer_norm_backward": ("bwd", "layer")})
KIND_FIELDS = ("dir", "norm", "dtype", "n")
CONFIG_FIELDS = ("kind", "norm", "dtype", "n", "vec")


# ---- the tables' problems ---------------------------------------------------------------------------------------
def table_problem(direction: str, norm: str, dtype: str, n: int, vec: int | None = None):
    """The problem a table row is measured on (see the module docstring)."""
    vec = vec or 16 // geometry.ITEMSIZE[dtype]
    layer = norm == "layer"
    if direction == "fwd":
        return geometry.FwdProblem(layer=layer, n=n, x=dtype, y=dtype, w=dtype, bias=layer, vec=vec)
    return geometry.BwdProblem(layer=layer, n=n, x=dtype, dy=dtype, dx=dtype, w=dtype, weight_grad=True,
                               bias_grad=layer, vec=vec)


def specs_for(direction: str, p, kind: str, cfg, arch) -> tuple:
    if direction == "fwd":
        return (geometry.fwd_spec(p, kind, cfg, arch),)
    return geometry.bwd_specs(p, kind, cfg, arch)


# ---- candidate configs ------------------------------------------------------------------------------------------
# OPT bits swept per kind (1 persistent / prefetch, 2 default-cached loads, 4 re-convert after the reduction).
OPTS = MappingProxyType({("fwd", "rows"): (0, 2, 1, 5), ("bwd", "rows"): (1, 5, 0),
        ("fwd", "cluster"): (0, 2, 5), ("bwd", "cluster"): (1, 5, 0)})
# l2c: the weight per row from L1 (8), two rows per iteration (32), column sums in shared memory (64). Four rows
# per iteration and a 64-register cap lost in every sweep (docs/performance.md, Norms) and are no longer kernels.
L2C_OPTS = (0, 8, 32, 40, 96)
L2C_POLICY_OPTS = (0, 32, 96)  # these also with the L2 access policies (OPT 256)
# Backward rows past the swept lengths (N > 65536): the kinds that serve them.
_S = geometry.SplitConfig
LONG_ROW_CONFIGS = MappingProxyType({
    "coop": (_S(512, 8, 0), _S(512, 16, 0), _S(1024, 16, 0), _S(512, 32, 0), _S(256, 32, 0)),
    "l2c": (_S(512, 8, 0), _S(1024, 8, 0), _S(512, 16, 0), _S(256, 16, 0), _S(512, 16, 32), _S(512, 16, 64)),
    "cluster": (_S(512, 8, 1), _S(1024, 8, 1)),
})


def rows_configs(n: int, vec: int, opts=(0, 1)) -> list[geometry.RowsConfig]:
    packs = n // vec
    out = []
    for nv in (1, 2, 3, 4, 5, 6, 8):
        if packs % nv:
            continue
        tpr = packs // nv
        for opt in opts:
            if tpr <= 32 and tpr & (tpr - 1) == 0:
                out += [geometry.RowsConfig(tpr, max(1, 128 // tpr), opt),
                        geometry.RowsConfig(tpr, max(1, 256 // tpr), opt)]
            elif tpr % 32 == 0 and tpr <= 1024:
                out.append(geometry.RowsConfig(tpr, 1, opt))
    c = geometry.rows_config(n, vec)
    out += [geometry.RowsConfig(c.tpr, c.rpb, opt) for opt in opts]
    return list(dict.fromkeys(out))


def split_configs(n: int, vec: int, itemsize: int, cap: int, lo: int, hi: int,
                  opts=(0, 1)) -> list[geometry.SplitConfig]:
    out = []
    for parts in (2, 4, 8):
        if parts > cap:
            continue
        for threads in (128, 256, 512):
            b = geometry.packs_per_thread(n, vec, threads, parts) * vec * itemsize
            if lo <= b <= hi and geometry.slice_cols(n, vec, parts) * (parts - 1) < n:
                out += [geometry.SplitConfig(threads, parts, opt) for opt in opts]
    return out


def affine_configs(p, optin: int) -> list[geometry.SplitConfig]:
    """Persistent cluster forward with the weight / bias slice in shared memory (OPT 512 with persist, raw x
    re-converted after the reduction, default-cached or streaming loads; with and without OPT 1024, the next
    row's statistics and cluster barrier before this row's write): 256-1024 threads, 2-8 blocks per row."""
    out = []
    for parts in (2, 4, 8):
        for threads in (256, 512, 1024):
            base = geometry.PERSIST | 4 | geometry.SMEM_AFFINE
            for opt in (base, base | 2, base | geometry.PIPE_STATS, base | 2 | geometry.PIPE_STATS):
                cfg = geometry.SplitConfig(threads, parts, opt)
                if 16 <= geometry.fwd_thread_bytes(p, "cluster", cfg) and \
                        geometry.fwd_feasible(p, "cluster", cfg, smem_optin=optin) is None:
                    out.append(cfg)
    return out


def l2_configs(p, backward: bool, sm90: bool, optin: int, l2_policy: bool = True) -> list[geometry.L2Config]:
    """Threads per block x min blocks per SM (forward: x default-cached pass 2; rows of 32 KB and more: x the
    largest shared-memory stash that lets 1-4 blocks share an SM; on sm_90, also each row split over a cluster of
    2 or 4 blocks, with and without a stash); with l2_policy, each (default-cached pass 2 aside) also with the L2
    access policies."""
    out = []
    feas = geometry.bwd_feasible if backward else geometry.fwd_feasible
    for threads in (128, 256, 512, 1024):
        for minb in (1, 2, 4, 8):  # minb 4 / 8 for 128-256 threads: a 64 / 32-register cap, more blocks per SM
            if minb * threads > 2048 or (minb == 2 and threads < 512) or (backward and threads == 128) or \
                    (minb > 2 and (backward or threads > 256)):
                continue
            for opt in ((1, 0) if backward else (0, 2)):
                cfg = geometry.L2Config(threads, minb, opt)
                if feas(p, "l2", cfg, smem_optin=optin) is None and (p.n // p.vec) >= threads // 2:
                    out.append(cfg)
    if not backward and p.n * geometry.ITEMSIZE[p.x] >= 32768:
        out += l2_stash_configs(p, optin)
        if sm90:
            out += l2_split_configs(p, optin)
    if l2_policy:
        out += [dataclasses.replace(c, opt=c.opt | geometry.L2_POLICY) for c in out if not c.opt & 2]
    return out


def _stash_minb(p, threads: int, stash: int) -> int:
    per_block = stash * threads * p.vec * geometry.ITEMSIZE[p.x] + 1024 + geometry.FWD_L2_STATIC_SMEM
    return min(SMEM_PER_SM // per_block, 2048 // threads, 4)


def _stash_fit(p, threads: int, blocks: int) -> int:
    return (SMEM_PER_SM // blocks - 1024 - geometry.FWD_L2_STATIC_SMEM) // (threads * p.vec * geometry.ITEMSIZE[p.x])


def l2_split_configs(p, optin: int) -> list[geometry.L2Config]:
    """Forward l2 with the row split over clusters of 2 / 4 blocks: 256-1024 threads, plain (minb 1 / 2, both
    pass-2 cache policies) and with the largest stash that fits 1-3 blocks per SM."""
    out = {}
    for parts in (2, 4):
        for threads in (256, 512, 1024):
            if geometry.slice_cols(p.n, p.vec, parts) // p.vec < threads // 2:
                continue
            for minb in (1, 2):
                if minb * threads <= 2048:
                    for opt in (0, 2):
                        out[(parts, threads, minb, opt, 0)] = geometry.L2Config(threads, minb, opt, 0, parts)
            nv = geometry.packs_per_thread(p.n, p.vec, threads, parts)
            for blocks in (1, 2, 3):
                if blocks * threads > 2048:
                    continue
                stash = min(nv, _stash_fit(p, threads, blocks))
                minb = _stash_minb(p, threads, stash)
                if stash >= 1:
                    out[(parts, threads, minb, 0, stash)] = geometry.L2Config(threads, minb, 0, stash, parts)
    return [c for c in out.values() if geometry.fwd_feasible(p, "l2", c, smem_optin=optin) is None]


def l2_stash_configs(p, optin: int) -> list[geometry.L2Config]:
    """Forward l2 with a stash: for 256-1024 threads and 1-4 blocks per SM, the largest stash that fits (and one
    pack less); minb = the blocks per SM the stash allows (the register cap that matches)."""
    out = {}
    for threads in (256, 512, 1024):
        nv = geometry.packs_per_thread(p.n, p.vec, threads)
        for blocks in (1, 2, 3, 4):
            if blocks * threads > 2048:
                continue
            fit = _stash_fit(p, threads, blocks)
            for stash in (min(nv, fit), min(nv, fit) - 1):
                cfg = geometry.L2Config(threads, _stash_minb(p, threads, stash), 0, stash)
                if stash >= 1 and geometry.fwd_feasible(p, "l2", cfg, smem_optin=optin) is None:
                    out[(threads, stash)] = cfg
    return list(out.values())


def stage_configs(p, optin: int) -> list[geometry.StageConfig]:
    """Staged backward: threads per block (4 to 32 columns per thread) x rows in flight that fit."""
    out = []
    for threads in (128, 160, 256, 320, 384, 512, 640, 768, 1024):  # 160 / 320 / 640: N = 5120 in whole packs
        cols = geometry.packs_per_thread(p.n, p.vec, threads) * p.vec
        if not 4 <= cols <= geometry.BWD_STAGE_MAX_THREAD_COLS or (p.n // p.vec) < threads // 2:
            continue
        for depth in (2, 3, 4, 6):
            cfg = geometry.StageConfig(threads, depth)
            if geometry.bwd_feasible(p, "stage", cfg, smem_optin=optin) is None:
                out.append(cfg)
    return out


def l2c_configs(p, optin: int, l2_policy: bool = True) -> list[geometry.SplitConfig]:
    """Cluster size (16: non-portable) x threads per block x OPT, 4 to 32 columns per thread."""
    opts = L2C_OPTS + (tuple(o | geometry.L2_POLICY for o in L2C_POLICY_OPTS) if l2_policy else ())
    out = []
    for parts in (2, 4, 8, 16):
        for threads in (128, 256, 512):
            cols = geometry.packs_per_thread(p.n, p.vec, threads, parts) * p.vec
            if not 4 <= cols <= geometry.BWD_L2C_MAX_THREAD_COLS:
                continue
            for opt in opts:
                cfg = geometry.SplitConfig(threads, parts, opt)
                if geometry.bwd_feasible(p, "l2c", cfg, smem_optin=optin) is None and \
                        geometry.slice_cols(p.n, p.vec, parts) // p.vec >= threads // 2:
                    out.append(cfg)
    return out


def _swept(direction: str, p, device, l2_policy: bool) -> list[tuple[str, Any]]:
    """(kind, config) the sweeps time for p (the rules that made the shipped tables)."""
    sm90 = not device.arch.gfx and device.arch.cc >= (9, 0)
    optin, warp = device.max_smem_per_block_optin, device.warp_size
    n, isz = p.n, geometry.ITEMSIZE[p.x]
    out: list[tuple[str, Any]] = []
    if direction == "fwd":
        out += [("l2", c) for c in l2_configs(p, False, sm90, optin, l2_policy)]
        out += [("rows", c) for c in rows_configs(n, p.vec, OPTS[("fwd", "rows")])
                if geometry.fwd_feasible(p, "rows", c, warp, optin) is None]
        if sm90 and n * isz >= 8192:
            out += [("cluster", c) for c in split_configs(n, p.vec, isz, geometry.MAX_CLUSTER, 16, 128,
                                                          OPTS[("fwd", "cluster")])
                    if geometry.fwd_feasible(p, "cluster", c, warp, optin) is None]
        if sm90 and n * isz >= 16384:
            out += [("cluster", c) for c in affine_configs(p, optin)]
        if n >= SWEPT_ROW_LIMIT:
            c = configs.fwd_heuristic(p, "coop", warp)
            out += [("coop", c)] if c is not None else []
        return out
    out += [("l2", c) for c in l2_configs(p, True, sm90, optin, l2_policy)]
    out += [("rows", c) for c in rows_configs(n, p.vec, OPTS[("bwd", "rows")])
            if geometry.bwd_feasible(p, "rows", c, warp, optin) is None]
    if sm90 and n * isz >= 8192:
        out += [("l2c", c) for c in l2c_configs(p, optin, l2_policy)]
    if n * isz >= 8192:
        out += [("stage", c) for c in stage_configs(p, optin)]
    if sm90 and n * isz >= 8192:
        swept = split_configs(n, p.vec, 1, geometry.MAX_CLUSTER, 4, geometry.BWD_MAX_THREAD_ELEMS,
                              OPTS[("bwd", "cluster")])
        out += [("cluster", c) for c in swept if geometry.bwd_feasible(p, "cluster", c, warp, optin) is None]
    if n >= SWEPT_ROW_LIMIT:
        c = configs.bwd_heuristic(p, "coop", warp)
        out += [("coop", c)] if c is not None else []
    if n > SWEPT_ROW_LIMIT:
        out += [(kind, c) for kind, cfgs in LONG_ROW_CONFIGS.items() for c in cfgs
                if (sm90 or kind == "coop") and geometry.bwd_feasible(p, kind, c, warp, optin) is None]
    return out


def sweep_configs(direction: str, p, device, kinds: Sequence[str] | None = None,
                  l2_policy: bool = True) -> list[tuple[str, Any]]:
    """Every (kind, config) to time for p on device: the swept configs (of `kinds` only, if given) and the config
    the tables or heuristics give each kind now, without duplicates."""
    sm90 = not device.arch.gfx and device.arch.cc >= (9, 0)
    out = [(k, c) for k, c in _swept(direction, p, device, l2_policy) if kinds is None or k in kinds]
    for kind in geometry.KINDS:
        if (direction == "fwd" and kind in geometry.BWD_ONLY_KINDS) or (kind in ("cluster", "l2c") and not sm90):
            continue
        cfg = (configs.fwd_config if direction == "fwd" else configs.bwd_config)(p, kind, device)
        if cfg is not None:
            out.append((kind, cfg))
    return list(dict.fromkeys(out))


def config_dict(kind: str, cfg) -> dict[str, Any]:
    return {"kind": kind, **configs.cfg_to_json(cfg)}


def config_of(config: Mapping[str, Any]) -> tuple[str, Any]:
    c = dict(config)
    kind = c.pop("kind")
    return kind, configs.cfg_from_json(kind, c)


# ---- measuring --------------------------------------------------------------------------------------------------
class Data:
    """Inputs for one (dtype, N) on the current CUDA device: x, dy, weight, bias; outputs y, dx, dweight, dbias;
    fp32 row statistics of x; float64 references on sampled rows."""

    def __init__(self, torch, dtype: str, n: int, rows: int | None = None):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.rows = rows or max(1, TUNE_ELEMENTS // n)
        g = torch.Generator(device="cuda")
        g.manual_seed(n * 7 + len(dtype))
        self.x = (torch.randn(self.rows, n, device="cuda", generator=g) + 0.5).to(dt)
        self.dy = torch.randn(self.rows, n, device="cuda", generator=g).to(dt)
        self.w = (1 + 0.2 * torch.randn(n, device="cuda", generator=g)).to(dt)
        self.b = (0.1 * torch.randn(n, device="cuda", generator=g)).to(dt)
        self.y = torch.empty_like(self.x)
        self.dx = torch.empty_like(self.x)
        self.dw = torch.empty_like(self.w)
        self.db = torch.empty_like(self.b)
        xf = self.x.float()
        self.mean = xf.mean(-1)
        self.rstd = {"rms": torch.rsqrt((xf * xf).mean(-1) + EPS),
                     "layer": torch.rsqrt(((xf - self.mean[:, None]) ** 2).mean(-1) + EPS)}
        del xf
        self.ref_dw: dict = {}

    def check_rows(self, torch):
        idx = list(range(min(32, self.rows))) + list(range(max(32, self.rows - 32), self.rows))
        return torch.tensor(idx, device="cuda")

    def ref_fwd(self, torch, norm: str, rows):
        x = self.x[rows].double()
        mean = x.mean(-1, keepdim=True) if norm == "layer" else 0.0
        xc = x - mean
        var = (xc * xc).mean(-1, keepdim=True)
        y = xc * torch.rsqrt(var + EPS) * self.w.double()
        return y + self.b.double() if norm == "layer" else y

    def ref_dx(self, torch, norm: str, rows):
        x, dy = self.x[rows].double(), self.dy[rows].double()
        n = x.shape[-1]
        mean = self.mean[rows].double()[:, None] if norm == "layer" else 0.0
        rstd = self.rstd[norm][rows].double()[:, None]
        xh = (x - mean) * rstd
        g = dy * self.w.double()
        c1 = (g * xh).sum(-1, keepdim=True) / n
        c0 = g.sum(-1, keepdim=True) / n if norm == "layer" else 0.0
        return rstd * (g - xh * c1 - c0)

    def reference_dw(self, torch, norm: str):
        if norm not in self.ref_dw:
            acc = torch.zeros(self.x.shape[1], dtype=torch.float64, device="cuda")
            accb = torch.zeros_like(acc)
            step = max(1, (1 << 24) // self.x.shape[1])
            for r0 in range(0, self.rows, step):
                x = self.x[r0:r0 + step].double()
                dy = self.dy[r0:r0 + step].double()
                mean = self.mean[r0:r0 + step].double()[:, None] if norm == "layer" else 0.0
                acc += (dy * (x - mean) * self.rstd[norm][r0:r0 + step].double()[:, None]).sum(0)
                accb += dy.sum(0)
            self.ref_dw[norm] = (acc, accb)
        return self.ref_dw[norm]


def rel_error(torch, out, ref) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def launcher(torch, data: Data, direction: str, p, kind: str, cfg, kernels):
    """fn() launching one config over all of data's rows on torch's current stream."""
    stream = torch.cuda.current_stream().cuda_stream
    layer = p.layer

    def ptr(t) -> int:
        return t.data_ptr() if t is not None else 0

    def zeros_u32(count):
        t = torch.zeros(count, dtype=torch.int32, device="cuda")
        return t, t.data_ptr()

    def empty_f32(count):
        t = torch.empty(count, dtype=torch.float32, device="cuda")
        return t, t.data_ptr()

    n = p.n
    if direction == "fwd":
        call = launch.FwdCall(x=ptr(data.x), residual=0, h=0, w=ptr(data.w), b=ptr(data.b) if layer else 0,
                              y=ptr(data.y), mean=0, rstd=0, eps=EPS, rows=data.rows, sx=n, sr=0, sh=0, sy=n,
                              stream=stream, zeros_u32=zeros_u32, empty_f32=empty_f32)
        return lambda: launch.launch_fwd(p, kind, cfg, kernels[0], call)
    norm = "layer" if layer else "rms"
    call = launch.BwdCall(x=ptr(data.x), w=ptr(data.w), dy=ptr(data.dy), dres=0,
                          mean=ptr(data.mean) if layer else 0, rstd=ptr(data.rstd[norm]), dx=ptr(data.dx),
                          dw=ptr(data.dw), db=ptr(data.db) if layer else 0, rows=data.rows, sx=n, sdy=n,
                          sdres=0, sdx=n, stream=stream, zeros_u32=zeros_u32, empty_f32=empty_f32)
    return lambda: launch.launch_bwd(p, kind, cfg, kernels, call)


def check(torch, data: Data, direction: str, norm: str) -> float:
    """Largest relative error of the last launch's outputs (sampled rows of y / dx, all of dweight / dbias)."""
    rows = data.check_rows(torch)
    if direction == "fwd":
        return rel_error(torch, data.y[rows], data.ref_fwd(torch, norm, rows))
    errs = [rel_error(torch, data.dx[rows], data.ref_dx(torch, norm, rows))]
    rw, rb = data.reference_dw(torch, norm)
    errs.append(rel_error(torch, data.dw, rw))
    if norm == "layer":
        errs.append(rel_error(torch, data.db, rb))
    return max(errs)


def timeit(fn, torch, reps: int = 10, inner: int = 3, warmup: int = 3) -> float:
    """Median seconds per call: `inner` calls queued behind a GPU sleep (the host's launch cost stays out)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(1_000_000)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) / inner)
    return statistics.median(samples) / 1e3


# ---- the tuner --------------------------------------------------------------------------------------------------
class NormTuner(tuning.Tuner):
    """Times every kind's configs for one norm op. Rows: the fastest config of each kind (norm_fwd / norm_bwd)
    and the fastest kind (norm_kind). `kinds`: only these kinds' swept configs (plus each kind's current one)."""

    key_fields = KIND_FIELDS

    def __init__(self, op: str, kinds: Sequence[str] | None = None, l2_policy: bool = True):
        self.op = op
        self.direction, self.norm = OPS[op]
        self.kinds = tuple(kinds) if kinds else None
        self.l2_policy = l2_policy
        self._data: tuple | None = None  # ((dtype, n), Data) of the shape being tuned

    def problem(self, req):
        return cands.fwd_problem(req) if self.direction == "fwd" else cands.bwd_problem(req)

    def key(self, req) -> dict[str, Any]:
        return {"dir": self.direction, "norm": self.norm, "dtype": req.dtype("x"), "n": req.dim("n")}

    def validate(self, req) -> None:
        n, x, vec = req.dim("n"), req.dtype("x"), req.dim("vec")
        want = cands.build_request(self.op, (n,), x, req.device, vec=str(vec))
        if (req.dtypes, req.flags) != (want.dtypes, want.flags):
            got = {**dict(req.dtypes), **dict(req.flags)}
            table = {**dict(want.dtypes), **dict(want.flags)}
            diff = ", ".join(f"{k}={got.get(k)!r} (tabled: {v!r})" for k, v in table.items() if got.get(k) != v)
            raise ValueError(f"{self.op}: the norm tables are keyed by (norm, dtype, N, vec) and measured on the "
                             f"default problem; this request differs: {diff}. Tune without those --opt values "
                             "(only vec= may be given)")

    def configs(self, req) -> list[dict[str, Any]]:
        p = self.problem(req)
        return [config_dict(k, c) for k, c in sweep_configs(self.direction, p, req.device, self.kinds,
                                                            self.l2_policy)]

    def table_names(self) -> list[str]:
        return [configs.TABLE_FWD if self.direction == "fwd" else configs.TABLE_BWD, configs.TABLE_KIND]

    def prepare(self, req, configs) -> None:
        p, arch = self.problem(req), req.device.target()
        specs = [s for c in configs for s in specs_for(self.direction, p, *config_of(c), arch)]
        failed = tuning.compile_ahead(specs)
        if failed:
            log.warning("%s: %d of %d kernels failed to compile (their configs are recorded as failing)",
                        self.op, failed, len(set(specs)))

    def data(self, torch, req) -> Data:
        key = (req.dtype("x"), req.dim("n"))
        if self._data is None or self._data[0] != key:
            self.release()
            self._data = (key, Data(torch, *key))
        return self._data[1]

    def release(self) -> None:
        """Free the device buffers of the last shape timed."""
        self._data = None

    def measure(self, req, config: Mapping[str, Any]) -> float:
        import torch

        if req.device.ordinal is None:
            raise RtckernError("measuring a norm config needs a live GPU")
        kind, cfg = config_of(config)
        p = self.problem(req)
        why = (geometry.fwd_feasible if self.direction == "fwd" else geometry.bwd_feasible)(
            p, kind, cfg, req.device.warp_size, req.device.max_smem_per_block_optin)
        if why is not None:
            raise RtckernError(why)
        with torch.cuda.device(req.device.ordinal):
            data = self.data(torch, req)
            kernels = launch.load(specs_for(self.direction, p, kind, cfg, req.device.target()), req.device.ordinal)
            fn = launcher(torch, data, self.direction, p, kind, cfg, kernels)
            data.y.fill_(float("nan"))
            data.dx.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = check(torch, data, self.direction, self.norm)
            if not err < TOL[p.x]:
                raise RtckernError(f"relative error {err:.3g} against float64 (limit {TOL[p.x]:g})")
            return timeit(fn, torch)

    def table_rows(self, req, winner: tuning.Row, trials: Sequence[tuning.Trial]):
        return norm_rows(self.direction, self.norm, req, winner, trials)


def norm_rows(direction: str, norm: str, req, winner: tuning.Row, trials: Sequence[tuning.Trial]):
    """(table, key fields, rows): the fastest config of each kind timed, and the fastest kind (coop only past the
    swept row lengths, as the shipped tables chose)."""
    dtype, n, vec = req.dtype("x"), req.dim("n"), req.dim("vec")
    p = table_problem(direction, norm, dtype, n, vec)
    rows = max(1, TUNE_ELEMENTS // n)
    base = {k: v for k, v in winner.meta.items() if k not in ("time_us", "configs_timed")}
    best: dict[str, tuning.Trial] = {}
    for t in trials:
        if t.seconds is not None:
            kind = t.config["kind"]
            if kind not in best or t.seconds < best[kind].seconds:
                best[kind] = t

    def meta(t: tuning.Trial) -> dict[str, Any]:
        return {"time_us": round(t.seconds * 1e6, 2), "gbps": round(p.bytes_moved(rows) / t.seconds / 1e9),
                **base}

    cfg_rows = []
    for kind in sorted(best):
        shape = (("kind", kind), ("norm", norm), ("dtype", dtype), ("n", n), ("vec", vec))
        cfg = {k: v for k, v in best[kind].config.items() if k != "kind"}
        cfg_rows.append(tuning.Row(winner.arch, winner.sm_count, shape, cfg, meta(best[kind]),
                                    device_class=winner.device_class))
    out = [(configs.TABLE_FWD if direction == "fwd" else configs.TABLE_BWD, CONFIG_FIELDS, cfg_rows)]
    eligible = {k: t for k, t in best.items() if k != "coop" or n > SWEPT_ROW_LIMIT}
    if eligible:
        kind = min(eligible, key=lambda k: eligible[k].seconds)
        shape = (("dir", direction), ("norm", norm), ("dtype", dtype), ("n", n))
        out.append((configs.TABLE_KIND, KIND_FIELDS,
                    [tuning.Row(winner.arch, winner.sm_count, shape, {"kind": kind}, meta(eligible[kind]),
                                device_class=winner.device_class)]))
    return out


def register_tuners() -> None:
    """Register a NormTuner under each norm op name (once; `rtckern tune <op>` finds them)."""
    have = set(tuning.tuner_ops())
    for op in OPS:
        if op not in have:
            tuning.register_tuner(NormTuner(op))
