"""The hot path of the softmax ops: a validated call signature (op, dtype, device, shape and strides of every
array, the mask's, the scale) becomes a plan (output dtype and shape, row geometry, scale as float32, and per
alignment class of the addresses the chosen kernel with its grid, block, shared memory and argument tail),
memoized for torch tensors. A repeated call reads pointers, allocates its output, does two dict lookups and
launches.

The key holds everything api.py's checks read, so a call that hits the memo passed them; anything else takes
the full path (same errors as before), which builds and stores the plan. Plans are rebuilt when the settings
change (config.override), as the selections are.
"""
from __future__ import annotations

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream, torch_stream_getter

from . import candidates as cands
from . import geometry

_MAX_PLANS = 4096
# classes that passed isinstance(obj, torch.Tensor) on the full path
_torch_types = PlanCache("softmax.torch_types", 64)
plans = PlanCache("softmax.call_plans", _MAX_PLANS)
_SCALARS = (float, int)  # scales a key holds as they are (others take the full path, which parses them)


def _tk(t) -> tuple:
    return (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride())


def key(op: str, a, b, scale) -> tuple | None:
    """The memo key of a call with arrays a (x or y) and b (mask or dy, may be None), or None when it cannot take
    the hot path."""
    tt = _torch_types
    if type(a) not in tt or (b is not None and type(b) not in tt) or type(scale) not in _SCALARS:
        return None
    return (op, _tk(a), None if b is None else _tk(b), scale)


def lookup(op: str, a, b, scale) -> "Plan | None":
    """The plan memoized for the call (op, a, b, scale) under the current settings, else None: key() and
    current_plan() in one function, since each Python call costs the hot path ~0.1 us (the key is built as key()
    builds it)."""
    tt = _torch_types
    if type(a) not in tt or type(scale) not in _SCALARS:
        return None
    if b is None:
        bk = None
    elif type(b) in tt:
        bk = (b.dtype, b.is_cuda, b.get_device(), b.shape, b.stride())
    else:
        return None
    p = plans.get((op, (a.dtype, a.is_cuda, a.get_device(), a.shape, a.stride()), bk, scale))
    return p if p is not None and p.settings is settings() else None


def remember(k_args, p: "Plan", *objs) -> None:
    """Store p for the call (op, a, b, scale) when its arrays are torch tensors."""
    for o in objs:
        if o is not None:
            _torch_types.put(type(o), True)
    k = key(*k_args)
    if k is not None:
        plans.put(k, p)


class Plan:
    """A validated signature of one softmax op (forward: ptrs (x, y, mask); backward: (y, dy, dx))."""

    __slots__ = ("settings", "op", "direction", "dtype", "geom", "scale", "shape", "torch_dtype", "device",
                 "index", "has_mask", "launchers", "like", "fast")

    def __init__(self, op: str, a: arr.DeviceArray, geom: geometry.RowGeometry, scale, has_mask: bool):
        """scale: a callable giving the float32 scale; called after the selection, where the ops always read
        it (so a bad scale raises after an unsupported request does, as before)."""
        self.settings = settings()
        self.op, self.direction = op, cands.OPS[op][1]
        self.dtype, self.geom, self.scale, self.shape = a.dtype, geom, scale, a.shape
        self.has_mask = has_mask
        self.launchers = {}
        self.fast = None  # f(a, b) -> the output, once the aligned launcher is prepared (torch only; _fast below)
        if a.lib == "torch":
            self.torch_dtype, self.device, self.index, self.like = a.obj.dtype, a.obj.device, a.obj.device.index, None
        else:  # not memoized: holds the array for its library's allocator and stream
            self.torch_dtype, self.device, self.index, self.like = None, None, a.device, a

    def forward(self, xp: int, mp: int):
        out, yp = self._empty()
        launch = self.launchers.get((xp & 15) | ((yp & 15) << 4) | ((mp & 15) << 8))
        if launch is None:
            launch = self._launcher((xp, yp), mp if self.has_mask else None)
        launch(xp, yp, mp, self._stream())
        return out

    def backward(self, yp: int, dyp: int):
        out, dxp = self._empty()
        launch = self.launchers.get((yp & 15) | ((dyp & 15) << 4) | ((dxp & 15) << 8))
        if launch is None:
            launch = self._launcher((yp, dyp, dxp), None)
        launch(yp, dyp, dxp, self._stream())
        return out

    def _empty(self):
        if self.like is None:
            import torch

            out = torch.empty(self.shape, dtype=self.torch_dtype, device=self.device)
            return out, out.data_ptr()
        return arr.empty(self.like, self.shape, self.dtype)

    def _stream(self) -> int:
        return torch_stream(self.index) if self.like is None else arr.current_stream(self.like)

    def _launcher(self, ptrs: tuple[int, ...], mask_ptr: int | None):
        g = self.geom
        if self.direction == geometry.FWD:
            k = (ptrs[0] & 15) | ((ptrs[1] & 15) << 4) | (((mask_ptr or 0) & 15) << 8)
        else:
            k = (ptrs[0] & 15) | ((ptrs[1] & 15) << 4) | ((ptrs[2] & 15) << 8)
        vec = geometry.vector_width(self.dtype, g.n, ptrs, mask_ptr)
        mask16 = None if mask_ptr is None else (g.n % 16 == 0 and mask_ptr % 16 == 0)
        sel = cands.selection(self.op, self.dtype, g.n, vec, self.index, mask16)
        cand, req, kernels = sel.candidate, sel.request, sel.kernels
        scale = self.scale()
        if type(cand) in (cands.OnePassCandidate, cands.RingCandidate):
            # What the candidate's launch computes per call, once: grid, block, shared memory, the arguments' tail.
            if type(cand) is cands.RingCandidate:
                cfg = cands.ring_config(self.direction, cand.kind, req)
                grid, block, smem = cands.ring_launch_geometry(kernels[0], self.direction, cand.kind, self.dtype, cfg,
                                                               g.rows, req.device.sm_count)
            else:
                cfg = cands._config_for(self.direction, req)
                smem = cfg.smem_bytes(self.direction, self.dtype, g.n, vec, cand.kind)
                grid, block = cfg.launch_grid(g), cfg.threads
            if self.direction == geometry.FWD:
                tail = geometry.fwd_args(0, 0, 0, g, scale)[3:]
            else:
                tail = geometry.bwd_args(0, 0, 0, g, scale)[3:]
            prepare = getattr(kernels[0], "prepare", None)  # a HIP kernel launches through Kernel.launch
            if prepare is not None:
                # three pointers, the long long sizes, the float scale (softmax_fwd / softmax_bwd and the ring's)
                go = prepare(grid, block, "PPP" + "q" * (len(tail) - 1) + "f", smem)

                def launch(p0, p1, p2, stream):
                    go(stream, p0, p1, p2, *tail)
                if k == 0 and self.like is None:
                    self.fast = _fast(self, go, tail)
            else:
                kl = kernels[0].launch

                def launch(p0, p1, p2, stream):
                    kl(grid, block, (p0, p1, p2) + tail, shared_mem=smem, stream=stream)
        else:
            # what the candidate reads of the input (library and device, for its workspace): the array itself, or
            # for torch a view without it (a memoized plan must not keep the caller's tensor alive)
            a = self.like or arr.DeviceArray(None, "torch", 0, self.shape, (), self.dtype, 0, self.index)

            def launch(p0, p1, p2, stream):
                cand.launch(req, kernels, a, (p0, p1, p2), g, scale, stream)
        self.launchers[k] = launch
        return launch


def _fast(p: Plan, go, tail: tuple):
    """The whole call for the common case (torch tensors, every address 16-byte aligned, a one-pass or ring
    kernel): the output as torch.empty_like of the (contiguous) input, the addresses, one prepared launch
    (rtckern.runtime Kernel.prepare). A call with an address off 16 bytes takes forward() / backward()."""
    import torch

    new_like, raw, index = torch.empty_like, torch_stream_getter(), p.index
    if p.direction == geometry.FWD:
        def fast(x, mask):
            y = new_like(x)
            xp, yp = x.data_ptr(), y.data_ptr()
            mp = 0 if mask is None else mask.data_ptr()
            if (xp | yp | mp) & 15:
                return p.forward(xp, mp)
            go(raw(index), xp, yp, mp, *tail)
            return y
        return fast

    def fast_backward(y, dy):
        dx = new_like(y)
        yp, dyp, dxp = y.data_ptr(), dy.data_ptr(), dx.data_ptr()
        if (yp | dyp | dxp) & 15:
            return p.backward(yp, dyp)
        go(raw(index), yp, dyp, dxp, *tail)
        return dx
    return fast_backward
