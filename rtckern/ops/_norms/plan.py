"""The hot path of the norm ops: a validated call signature becomes a plan (output shapes and dtypes, row
strides, eps as float32, and per pointer-alignment class the chosen kernel with its launch geometry), memoized for
torch tensors, so a repeated call reads pointers, allocates its outputs, does two dict lookups and launches
(DESIGN: "after the first call the hot path is a dict lookup and a launch").

The memo key holds everything the checks in api.py read (dtype, device, shape and strides of every array, eps
and the flags), so a call that hits the memo is one that passed them; anything else (a new signature, CuPy arrays,
an unusual eps type) takes the full path, which raises the same errors as before and builds the plan. Plans hold
the settings object they were made under and are rebuilt when the settings change (config.override).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.dtypes import torch_dtype
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream, torch_stream_getter

from . import geometry
from .launch import BwdCall, FwdCall

_MAX_PLANS = 4096  # distinct signatures kept (row counts vary in prefill); past it the memo starts over
_torch_types = PlanCache("norms.torch_types", 64)  # classes that passed isinstance(obj, torch.Tensor) on the full path
fwd_plans = PlanCache("norms.fwd_call_plans", _MAX_PLANS)
bwd_plans = PlanCache("norms.bwd_call_plans", _MAX_PLANS)


def remember_torch_type(obj: Any) -> None:
    _torch_types.put(type(obj), True)


def _tk(t) -> tuple | None:
    return None if t is None else (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride())


def fwd_key(layer, x, w, b, eps, r, zc, out_dtype, save) -> tuple | None:
    """The memo key of a forward call, or None when it cannot take the hot path (not all torch tensors)."""
    tt = _torch_types
    if type(x) not in tt or (w is not None and type(w) not in tt) or (b is not None and type(b) not in tt) or \
            (r is not None and type(r) not in tt) or type(eps) not in (float, int):
        return None
    return (layer, x.dtype, x.is_cuda, x.get_device(), x.shape, x.stride(), _tk(w), _tk(b), _tk(r), eps, zc,
            out_dtype, save)


def bwd_key(layer, dy, x, w, b, mean, rstd, zc, dres, dx_dtype, wg, bg) -> tuple | None:
    tt = _torch_types
    for t in (dy, x, w, b, mean, rstd, dres):
        if t is not None and type(t) not in tt:
            return None
    return (layer, _tk(dy), x.dtype, x.is_cuda, x.get_device(), x.shape, x.stride(), _tk(w), _tk(b), _tk(mean),
            _tk(rstd), _tk(dres), zc, dx_dtype, wg, bg)


def store(plans: PlanCache, key, plan) -> None:
    plans.put(key, plan)


# ---- allocation -------------------------------------------------------------------------------------------------
class _TorchAlloc:
    """Outputs and workspaces on one torch device (what arr.empty / arr.zeros / arr.workspace do, without the
    wrapper)."""

    __slots__ = ("torch", "device", "index", "dtypes")

    def __init__(self, device):
        import torch

        self.torch, self.device, self.index = torch, device, device.index
        self.dtypes = {n: torch_dtype(n) for n in geometry.DTYPES}

    def empty(self, shape, dtype: str):
        t = self.torch.empty(shape, dtype=self.dtypes[dtype], device=self.device)
        return t, t.data_ptr()

    def zeros(self, shape, dtype: str):
        t = self.torch.zeros(shape, dtype=self.dtypes[dtype], device=self.device)
        return t, t.data_ptr()

    def zeros_u32(self, count: int):
        t = self.torch.zeros((count,), dtype=self.torch.int32, device=self.device)
        return t, t.data_ptr()

    def empty_f32(self, count: int):
        t = self.torch.empty((count,), dtype=self.torch.float32, device=self.device)
        return t, t.data_ptr()

    def stream(self) -> int:
        return torch_stream(self.index)


class _LikeAlloc:
    """Any library through rtckern.runtime.arrays (CuPy; not memoized: it holds the input array)."""

    __slots__ = ("like",)

    def __init__(self, like: arr.Rows):
        self.like = like

    def empty(self, shape, dtype: str):
        return arr.empty(self.like, shape, dtype)

    def zeros(self, shape, dtype: str):
        return arr.zeros(self.like, shape, dtype)

    def zeros_u32(self, count: int):  # barrier counters: zeroed 32-bit words
        return arr.zeros(self.like, (count,), "int32")

    def empty_f32(self, count: int):
        return arr.workspace(self.like, 4 * count)

    def stream(self) -> int:
        return arr.current_stream(self.like)


def allocator(xa: arr.Rows):
    return _TorchAlloc(xa.obj.device) if xa.lib == "torch" else _LikeAlloc(xa)


def _align_bits(*ptrs: int) -> int:
    """Each address's low 4 bits side by side: all that geometry.byte_alignment reads of an address (it stops at 16)."""
    k = 0
    for p in ptrs:
        k = (k << 4) | (p & 15)
    return k


# ---- forward ----------------------------------------------------------------------------------------------------
class FwdPlan:
    """A validated forward signature. `decide(op, dtypes, flags, vec)` is api.py's selection (request,
    candidate, kernels); launchers are memoized per alignment class of the call's addresses."""

    __slots__ = ("settings", "alloc", "layer", "op", "shape", "stat_shape", "x_dtype", "y_dtype", "w_dtype",
                 "has_w", "has_b", "has_r", "want_mean", "want_rstd", "rows", "n", "sx", "sw", "sb", "sr", "eps",
                 "isz", "zero_centered", "launchers", "decide", "single", "like_x", "fast")

    def run(self, xp: int, wp: int, bp: int, rp: int):
        alloc = self.alloc
        y, yp = alloc.empty(self.shape, self.y_dtype)
        out = [y]
        h = hp = mp = rsp = 0
        if self.has_r:
            h, hp = alloc.empty(self.shape, self.x_dtype)
            out.append(h)
        if self.want_mean:
            mean, mp = alloc.empty(self.stat_shape, "fp32")
            out.append(mean)
        if self.want_rstd:
            rstd, rsp = alloc.empty(self.stat_shape, "fp32")
            out.append(rstd)
        key = _align_bits(xp, wp, bp, rp, yp, hp)
        launch = self.launchers.get(key)
        if launch is None:
            launch = self._launcher(key, xp, wp, bp, rp, yp, hp)
        launch(xp, rp, hp, wp, bp, yp, mp, rsp, alloc.stream())
        return y if self.single else tuple(out)

    def _launcher(self, key, xp, wp, bp, rp, yp, hp):
        n, isz = self.n, self.isz
        isz_y = geometry.ITEMSIZE[self.y_dtype]
        pairs = [(isz[self.x_dtype], geometry.byte_alignment(xp, self.sx * isz[self.x_dtype])),
                 (isz_y, geometry.byte_alignment(yp, n * isz_y))]
        if self.has_w:
            pairs.append((isz[self.w_dtype], geometry.byte_alignment(wp, self.sw * isz[self.w_dtype])))
        if self.has_b:
            pairs.append((isz[self.w_dtype], geometry.byte_alignment(bp, self.sb * isz[self.w_dtype])))
        if self.has_r:
            pairs += [(isz[self.x_dtype], geometry.byte_alignment(rp, self.sr * isz[self.x_dtype])),
                      (isz[self.x_dtype], geometry.byte_alignment(hp, n * isz[self.x_dtype]))]
        vec = geometry.pick_vec(n, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))
        flags = (("bias", self.has_b), ("residual", self.has_r), ("save_stats", self.want_rstd),
                 ("weight", self.has_w), ("zero_centered", self.zero_centered))
        dtypes = (("w", self.w_dtype or "none"), ("x", self.x_dtype), ("y", self.y_dtype))
        req, cand, kernels = self.decide(self.op, dtypes, flags, vec)
        launch = _fwd_launcher(self, req, cand, kernels)
        self.launchers[key] = launch
        go = getattr(launch, "prepared", None)
        if key == 0 and go is not None and self.single and type(self.alloc) is _TorchAlloc:
            self.fast = _fast_forward(self, go)
        return launch


# Kernel parameters of rtk_norm_fwd_rows: x, residual, h, w, b, y, mean, rstd (pointers), eps (float), rows and four
# row strides (long long).
ROW_KINDS = "PPPPPPPPfqqqqq"


def _fast_forward(p: FwdPlan, go):
    """The whole call for the common case (torch tensors, one output, every address 16-byte aligned, the row
    kernel): allocate, read four addresses, launch (a prepared launch: rtckern.runtime Kernel.prepare). Calls with
    an address off 16 bytes take run(), which picks the launcher of their alignment class."""
    import torch

    new_like, empty, raw = torch.empty_like, torch.empty, torch_stream_getter()
    like, shape, dt, dev, index = p.like_x, p.shape, p.alloc.dtypes[p.y_dtype], p.alloc.device, p.alloc.index
    e32, rows, sx, n, run = p.eps, p.rows, p.sx, p.n, p.run

    def fast(x, w, b):
        y = new_like(x) if like else empty(shape, dtype=dt, device=dev)
        xp, yp = x.data_ptr(), y.data_ptr()
        wp = 0 if w is None else w.data_ptr()
        bp = 0 if b is None else b.data_ptr()
        if (xp | yp | wp | bp) & 15:
            return run(xp, wp, bp, 0)
        go(raw(index), xp, 0, 0, wp, bp, yp, 0, 0, e32, rows, sx, 0, n, n)
        return y
    return fast


def _fwd_launcher(p: FwdPlan, req, cand, kernels):
    """The call's launch: for the row kernel a precomputed grid and block around Kernel.launch; for the others
    (cluster, cooperative: a workspace per call) the candidate's own launch."""
    rows, n, sx, sr, e32 = p.rows, p.n, p.sx, p.sr, p.eps
    fast = getattr(cand, "row_launch_geometry", None)
    geom = fast(req, kernels, rows) if fast is not None else None
    if geom is not None:
        grid, block, smem = geom
        prepare = getattr(kernels[0], "prepare", None)  # a HIP kernel launches through Kernel.launch
        if prepare is not None:
            go = prepare(grid, block, ROW_KINDS, smem)

            def launch(xp, rp, hp, wp, bp, yp, mp, rsp, stream):
                go(stream, xp, rp, hp, wp, bp, yp, mp, rsp, e32, rows, sx, sr, n, n)
            launch.prepared = go
            return launch
        kl = kernels[0].launch

        def launch(xp, rp, hp, wp, bp, yp, mp, rsp, stream):
            kl(grid, block, [xp, rp, hp, wp, bp, yp, mp, rsp, e32, rows, sx, sr, n, n], smem, stream)
        return launch
    alloc = p.alloc

    def launch(xp, rp, hp, wp, bp, yp, mp, rsp, stream):
        cand.launch(req, kernels, FwdCall(x=xp, residual=rp, h=hp, w=wp, b=bp, y=yp, mean=mp, rstd=rsp, eps=e32,
                                          rows=rows, sx=sx, sr=sr, sh=n, sy=n, stream=stream,
                                          zeros_u32=alloc.zeros_u32, empty_f32=alloc.empty_f32))
    return launch


def fwd_plan(layer, op, xa: arr.Rows, wa, ba, ra, y_dtype: str, eps: float, zero_centered, save_stats,
             decide) -> FwdPlan:
    p = FwdPlan()
    p.settings = settings()
    p.alloc = allocator(xa)
    p.layer, p.op = layer, op
    p.shape, p.stat_shape = xa.shape, xa.shape[:-1]
    p.x_dtype, p.y_dtype = xa.dtype, y_dtype
    p.w_dtype = wa.dtype if wa is not None else (ba.dtype if ba is not None else None)
    p.has_w, p.has_b, p.has_r = wa is not None, ba is not None, ra is not None
    p.want_rstd = bool(save_stats)
    p.want_mean = p.want_rstd and layer
    p.rows, p.n, p.sx = xa.rows, xa.n, xa.row_stride
    p.sw = wa.row_stride if wa is not None else 0
    p.sb = ba.row_stride if ba is not None else 0
    p.sr = ra.row_stride if ra is not None else 0
    p.eps = np.float32(eps)
    p.isz = geometry.ITEMSIZE
    p.zero_centered = bool(zero_centered)
    p.launchers = {}
    p.decide = decide
    p.single = not (p.has_r or p.want_rstd)
    p.like_x = False  # set by the caller: torch input, contiguous, output dtype its own (torch.empty_like serves)
    p.fast = None
    return p


# ---- backward ---------------------------------------------------------------------------------------------------
class BwdPlan:
    __slots__ = ("settings", "alloc", "layer", "op", "shape", "n", "rows", "x_dtype", "dy_dtype", "dx_dtype",
                 "w_dtype", "has_w", "has_dres", "want_dw", "want_db", "sx", "sdy", "sw", "sdres", "zero_centered",
                 "launchers", "decide", "like", "fast")

    def run(self, xp: int, wp: int, dyp: int, dresp: int, mp: int, rsp: int):
        alloc = self.alloc
        dx, dxp = alloc.empty(self.shape, self.dx_dtype)
        dw = db = None
        dwp = dbp = 0
        if self.want_dw:
            dw, dwp = alloc.empty((self.n,), self.w_dtype)
        if self.want_db:
            db, dbp = alloc.empty((self.n,), self.w_dtype)
        key = _align_bits(xp, wp, dyp, dresp, dxp)
        launch = self.launchers.get(key)
        if launch is None:
            launch = self._launcher(key, xp, wp, dyp, dresp, dxp)
        launch(xp, wp, dyp, dresp, mp, rsp, dxp, dwp, dbp, alloc.stream())
        return (dx, dw, db) if self.layer else (dx, dw)

    def _launcher(self, key, xp, wp, dyp, dresp, dxp):
        n, isz = self.n, geometry.ITEMSIZE
        pairs = [(isz[self.x_dtype], geometry.byte_alignment(xp, self.sx * isz[self.x_dtype])),
                 (isz[self.dy_dtype], geometry.byte_alignment(dyp, self.sdy * isz[self.dy_dtype])),
                 (isz[self.dx_dtype], geometry.byte_alignment(dxp, n * isz[self.dx_dtype]))]
        if self.has_w:
            pairs.append((isz[self.w_dtype], geometry.byte_alignment(wp, self.sw * isz[self.w_dtype])))
        if self.has_dres:
            pairs.append((isz[self.dx_dtype], geometry.byte_alignment(dresp, self.sdres * isz[self.dx_dtype])))
        vec = geometry.pick_vec(n, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))
        flags = (("bias_grad", self.want_db), ("dresidual", self.has_dres), ("weight", self.has_w),
                 ("weight_grad", self.want_dw), ("zero_centered", self.zero_centered))
        dtypes = (("dx", self.dx_dtype), ("dy", self.dy_dtype), ("w", self.w_dtype or "none"), ("x", self.x_dtype))
        req, cand, kernels = self.decide(self.op, dtypes, flags, vec)
        rows, sx, sdy, sdres, alloc = self.rows, self.sx, self.sdy, self.sdres, self.alloc
        geom = getattr(cand, "bwd_launch_geometry", None)
        geom = geom(req, kernels, rows) if geom is not None else None
        if geom is not None and all(hasattr(k, "prepare") for k in kernels):
            launch = _bwd_row_launcher(self, kernels, *geom)
            if key == 0 and type(alloc) is _TorchAlloc and self.like is not None:
                self.fast = _fast_backward(self, launch)
            self.launchers[key] = launch
            return launch

        def launch(xp, wp, dyp, dresp, mp, rsp, dxp, dwp, dbp, stream):
            cand.launch(req, kernels, BwdCall(x=xp, w=wp, dy=dyp, dres=dresp, mean=mp, rstd=rsp, dx=dxp, dw=dwp,
                                              db=dbp, rows=rows, sx=sx, sdy=sdy, sdres=sdres, sdx=n, stream=stream,
                                              zeros_u32=alloc.zeros_u32, empty_f32=alloc.empty_f32))
        self.launchers[key] = launch
        return launch


# rtk_norm_bwd_rows (and the l2 / stage kernels): x, w, dy, dres, mean, rstd, dx, dw_part, db_part, rows and four
# row strides; rtk_norm_dw_reduce: dw_part, db_part, dw, db, parts, n.
BWD_ROW_KINDS = "PPPPPPPPPqqqqq"
DW_REDUCE_KINDS = "PPPPqq"


def _bwd_row_launcher(p: BwdPlan, kernels, parts: int, block: int, smem: int):
    """launch(xp, wp, dyp, dresp, mp, rsp, dxp, dwp, dbp, stream) for the row kernels: prepared launches of the
    main kernel and the weight/bias-gradient reduce, the partial sums in one float32 workspace per call (freed
    after the launches: torch's allocator orders its reuse on the stream)."""
    rows, sx, sdy, sdres, n = p.rows, p.sx, p.sdy, p.sdres, p.n
    main = kernels[0].prepare(parts, block, BWD_ROW_KINDS, smem)
    grads = int(p.want_dw) + int(p.want_db)
    red = kernels[1].prepare(-(-n // geometry.DW_REDUCE_COLS), geometry.DW_REDUCE_BLOCK, DW_REDUCE_KINDS) \
        if grads else None
    empty_f32, span = p.alloc.empty_f32, 4 * parts * n

    def launch(xp, wp, dyp, dresp, mp, rsp, dxp, dwp, dbp, stream):
        pw = pb = 0
        if grads:
            ws, base = empty_f32(grads * parts * n)
            pw = base if p.want_dw else 0
            pb = (base + span if p.want_dw else base) if p.want_db else 0
        main(stream, xp, wp, dyp, dresp, mp, rsp, dxp, pw, pb, rows, sx, sdy, sdres, n)
        if grads:
            red(stream, pw, pb, dwp, dbp, parts, n)
            del ws  # after both launches are queued
    return launch


def _fast_backward(p: BwdPlan, launch):
    """The whole backward call for the common case (torch tensors, every address 16-byte aligned, a row kernel):
    outputs by torch.empty_like of x and w, then the prepared launches. Other alignments take run()."""
    import torch

    new_like, empty, raw = torch.empty_like, torch.empty, torch_stream_getter()
    like_x = p.like
    shape, dt, dev, index = p.shape, p.alloc.dtypes[p.dx_dtype], p.alloc.device, p.alloc.index
    want_dw, want_db, layer, run = p.want_dw, p.want_db, p.layer, p.run

    def fast(dy, x, w, dres, mean, rstd):
        dx = new_like(x) if like_x else empty(shape, dtype=dt, device=dev)
        dw = new_like(w) if want_dw else None
        db = new_like(w) if want_db else None
        xp, dyp, dxp = x.data_ptr(), dy.data_ptr(), dx.data_ptr()
        wp = 0 if w is None else w.data_ptr()
        dresp = 0 if dres is None else dres.data_ptr()
        if (xp | dyp | dxp | wp | dresp) & 15:
            return run(xp, wp, dyp, dresp, 0 if mean is None else mean.data_ptr(), rstd.data_ptr())
        launch(xp, wp, dyp, dresp, 0 if mean is None else mean.data_ptr(), rstd.data_ptr(), dxp,
               0 if dw is None else dw.data_ptr(), 0 if db is None else db.data_ptr(), raw(index))
        return (dx, dw, db) if layer else (dx, dw)
    return fast


def bwd_plan(layer, op, xa: arr.Rows, dya: arr.Rows, wa, dra, dx_dtype: str, w_dtype, want_dw, want_db,
             zero_centered, decide) -> BwdPlan:
    p = BwdPlan()
    p.settings = settings()
    p.alloc = allocator(xa)
    p.layer, p.op = layer, op
    p.shape, p.n, p.rows = xa.shape, xa.n, xa.rows
    p.x_dtype, p.dy_dtype, p.dx_dtype, p.w_dtype = xa.dtype, dya.dtype, dx_dtype, w_dtype
    p.has_w, p.has_dres = wa is not None, dra is not None
    p.want_dw, p.want_db = want_dw, want_db
    p.sx, p.sdy = xa.row_stride, dya.row_stride
    p.sw = wa.row_stride if wa is not None else 0
    p.sdres = dra.row_stride if dra is not None else 0
    p.zero_centered = bool(zero_centered)
    p.launchers = {}
    p.decide = decide
    p.like = None  # set by the caller for torch: whether torch.empty_like(x) / (w) give dx / dw, db (see _fast_backward)
    p.fast = None
    return p
