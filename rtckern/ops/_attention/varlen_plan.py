"""The hot path of attention_varlen: a validated call signature (dtype, device, shape, strides and 16-byte alignment
of q, k, v; dtype, device, length and stride of the prefix sums; the types of max_seqlen_q / max_seqlen_k; causal;
the scale; return_lse) becomes a plan (output shapes, the selection, block and shared memory, the kernel's fixed
arguments), memoized for torch tensors. A repeated call checks the two max_seqlen ints against the totals, reads
five pointers, allocates o (and lse), does a dict lookup and launches; the grid's x extent comes from
max_seqlen_q, so calls that differ only in their sequence lengths share a plan.

The key holds everything varlen.py's checks read, with the exact types of causal, softmax_scale and
the max_seqlen arguments (causal=1 must still be refused, and a device scalar never reaches the host), so a call
that hits the memo is one that passed them. Plans are rebuilt when the settings change (config.override).
"""
from __future__ import annotations


from rtckern.caches import PlanCache
from rtckern.config import settings
from . import configs
from . import varlen_candidates as vc
from rtckern.runtime.streams import torch_stream

_MAX_PLANS = 4096
_torch_types = PlanCache("attention_varlen.torch_types", 64)  # classes that passed the full path's checks
plans = PlanCache("attention_varlen.call_plans", _MAX_PLANS)
_SCALE_TYPES = (type(None), float, int)


def key(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse) -> tuple | None:
    tt = _torch_types
    if type(q) not in tt or type(k) not in tt or type(v) not in tt or type(cu_q) not in tt or type(cu_k) not in tt \
            or type(max_q) is not int or type(max_k) is not int or type(causal) is not bool or \
            type(softmax_scale) not in _SCALE_TYPES:
        return None
    return (q.dtype, q.is_cuda, q.get_device(), q.shape, q.stride(), q.data_ptr() & 15,
            k.dtype, k.is_cuda, k.get_device(), k.shape, k.stride(), k.data_ptr() & 15,
            v.dtype, v.is_cuda, v.get_device(), v.shape, v.stride(), v.data_ptr() & 15,
            cu_q.dtype, cu_q.is_cuda, cu_q.get_device(), cu_q.shape, cu_q.stride(),
            cu_k.dtype, cu_k.is_cuda, cu_k.get_device(), cu_k.shape, cu_k.stride(),
            causal, type(softmax_scale), softmax_scale, bool(return_lse))


def lookup(k):
    p = plans.get(k)
    if p is not None and p.settings is settings():
        return p
    return None


def remember(p: "Plan", q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse) -> None:
    for t in (q, k, v, cu_q, cu_k):
        _torch_types.put(type(t), True)
    kk = key(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse)
    if kk is not None:
        plans.put(kk, p)


class Plan:
    """One validated torch signature with its selection and launch."""

    __slots__ = ("settings", "total_q", "total_k", "o_shape", "lse_shape", "dtype", "device", "index", "launch", "bm",
                 "_torch")

    def __init__(self, qa, ka, va, batch: int, req, sel, scale: float, return_lse: bool):
        import torch

        self.settings = settings()
        tq, hq, d = qa.shape
        self.total_q, self.total_k = tq, ka.shape[0]
        self.o_shape, self.lse_shape = (tq, hq, d), ((hq, tq) if return_lse else None)
        self.dtype, self.device, self.index = qa.obj.dtype, qa.obj.device, qa.device
        self._torch = torch
        self.bm = sel.candidate.tile(req).bm
        self.launch = _launcher(req, sel, qa, ka, va, batch, scale)

    def grid_x(self, max_seqlen_q: int) -> int:
        return -(-max_seqlen_q // self.bm)

    def run(self, qp: int, kp: int, vp: int, cqp: int, ckp: int, max_seqlen_q: int, return_lse: bool):
        empty = self._torch.empty
        o = empty(self.o_shape, dtype=self.dtype, device=self.device)
        lse = empty(self.lse_shape, dtype=self._torch.float32, device=self.device) if return_lse else None
        gx = -(-max_seqlen_q // self.bm)
        if gx:
            self.launch(qp, kp, vp, cqp, ckp, o.data_ptr(), lse.data_ptr() if return_lse else 0, gx,
                        torch_stream(self.index))
        return (o, lse) if return_lse else o


def _launcher(req, sel, qa, ka, va, batch: int, scale: float):
    """launch(q, k, v, cu_q, cu_k, o, lse pointers, grid x, stream) for the selected candidate, its per-call work
    done once: for the cp.async / mma kernels the block, shared memory and size and stride arguments; for the TMA
    kernel a prepared parameter block (PreparedWsVarlen); for any other candidate its launch."""
    cand, kernels = sel.candidate, sel.kernels
    # Views without the arrays: a memoized plan must not keep the caller's tensors alive.
    qa, ka, va = qa.at(qa.ptr), ka.at(ka.ptr), va.at(va.ptr)
    tq, hq, d = qa.shape
    if type(cand) is vc.Sm90Ws:
        return PreparedWsVarlen(kernels[0], cand.tile(req), req.dtype("qkv"), qa, ka, va, batch, scale).launch
    if type(cand) in (vc.Sm90Wgmma, vc.Sm80Mma, vc.Simt):
        tile = cand.tile(req)
        block, smem = tile.threads, tile.smem_bytes(d)
        mid = vc.kernel_args(qa, ka, va, 0, 0, 0, 0, scale)[5:22]
        kl = kernels[0].launch

        def launch(qp, kp, vp, cqp, ckp, op, lp, gx, stream):
            kl((gx, hq, batch), block, (qp, kp, vp, op, lp) + mid + (cqp, ckp), shared_mem=smem, stream=stream)
        return launch

    def launch(qp, kp, vp, cqp, ckp, op, lp, gx, stream):
        cand.launch(req, kernels, qa.at(qp), ka.at(kp), va.at(vp), cqp, ckp, batch, gx * cand.tile(req).bm, op, lp,
                    scale, stream)
    return launch


# flash_fwd_sm90_ws's parameters in varlen mode: the K and V maps, q / o / lse, ten sizes and strides, the scale, the
# two prefix-sum addresses
WS_VARLEN_KINDS = "MMPPP" + "q" * 10 + "f" + "PP"


class PreparedWsVarlen:
    """The TMA kernel's varlen launch for one call signature (as launch.PreparedWs for the dense op): a prepared launch
    per grid width (the grid follows max_seqlen_q), the sizes, strides and scale bound; a call passes five addresses
    and the K / V tensor maps, encoded again only when K's or V's address changed."""

    def __init__(self, kernel, tile, dtype: str, q, k, v, batch: int, scale: float):
        self.kernel, self.tile, self.dtype, self.k, self.v = kernel, tile, dtype, k, v
        self.heads_q, self.batch = q.shape[1], batch
        self.threads, self.smem = tile.threads, tile.smem_bytes(configs.ws_kernel_dim(q.shape[2]))
        self.ints = vc.ws_ints(q, k)
        self.scale = scale * vc._LOG2E
        self.by_width = PlanCache("attention_varlen.ws_launches", 64)  # grid width -> prepared launch
        self.kmap = self.vmap = (None, b"")

    def _map(self, t, ptr: int) -> bytes:
        from . import launch as tma

        return tma.kv_tensor_map(self.dtype, vc.packed_4d(t.at(ptr)), self.tile.bn)

    def launch(self, qp: int, kp: int, vp: int, cqp: int, ckp: int, op: int, lp: int, gx: int, stream: int) -> None:
        go = self.by_width.get(gx)
        if go is None:
            go = self.by_width.put(gx, self.kernel.prepare((gx, self.heads_q, self.batch), (self.threads, 1, 1),
                                                           WS_VARLEN_KINDS, self.smem))
        km, vm = self.kmap, self.vmap
        if km[0] != kp:
            km = self.kmap = (kp, self._map(self.k, kp))
        if vm[0] != vp:
            vm = self.vmap = (vp, self._map(self.v, vp))
        go(stream, km[1], vm[1], qp, op, lp, *self.ints, self.scale, cqp, ckp)
