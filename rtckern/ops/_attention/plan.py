"""The hot path of the attention op: a validated call signature (dtype, device, shape, strides and 16-byte
alignment of q, k, v; causal; the scale; return_lse) becomes a plan (output shapes, the selection, the tile's grid,
block and shared memory, and the kernel's fixed arguments), memoized for torch tensors. A repeated call reads
three pointers, allocates o (and lse), does a dict lookup and launches.

The key holds everything api.py's checks read, with the exact types of causal and softmax_scale (causal=1
must still be refused), so a call that hits the memo is one that passed them. Plans are rebuilt when the settings
change (config.override).
"""
from __future__ import annotations

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.runtime.streams import torch_stream

from . import candidates as cands
from .launch import PreparedWs, kernel_args

_MAX_PLANS = 4096
_torch_types = PlanCache("attention.torch_types", 64)  # classes that passed the full path's checks
plans = PlanCache("attention.call_plans", _MAX_PLANS)
_SCALE_TYPES = (type(None), float, int)


def key(q, k, v, causal, softmax_scale, return_lse) -> tuple | None:
    tt = _torch_types
    if type(q) not in tt or type(k) not in tt or type(v) not in tt or type(causal) is not bool or \
            type(softmax_scale) not in _SCALE_TYPES:
        return None
    return (q.dtype, q.is_cuda, q.get_device(), q.shape, q.stride(), q.data_ptr() & 15,
            k.dtype, k.is_cuda, k.get_device(), k.shape, k.stride(), k.data_ptr() & 15,
            v.dtype, v.is_cuda, v.get_device(), v.shape, v.stride(), v.data_ptr() & 15,
            causal, type(softmax_scale), softmax_scale, bool(return_lse))


def remember(p: "Plan", q, k, v, causal, softmax_scale, return_lse) -> None:
    for t in (q, k, v):
        _torch_types.put(type(t), True)
    kk = key(q, k, v, causal, softmax_scale, return_lse)
    if kk is not None:
        plans.put(kk, p)


class Plan:
    """One validated torch signature with its selection and launch."""

    __slots__ = ("settings", "o_shape", "lse_shape", "dtype", "device", "index", "launch", "_torch")

    def __init__(self, qa, ka, va, req, sel, scale: float, return_lse: bool):
        import torch

        self.settings = settings()
        b, sq, hq, d = qa.shape
        self.o_shape, self.lse_shape = (b, sq, hq, d), ((b, hq, sq) if return_lse else None)
        self.dtype, self.device, self.index = qa.obj.dtype, qa.obj.device, qa.device
        self._torch = torch
        self.launch = _launcher(req, sel, qa, ka, va, scale)

    def run(self, qp: int, kp: int, vp: int, return_lse: bool):
        empty = self._torch.empty
        o = empty(self.o_shape, dtype=self.dtype, device=self.device)
        if return_lse:
            lse = empty(self.lse_shape, dtype=self._torch.float32, device=self.device)
            self.launch(qp, kp, vp, o.data_ptr(), lse.data_ptr(), torch_stream(self.index))
            return o, lse
        self.launch(qp, kp, vp, o.data_ptr(), 0, torch_stream(self.index))
        return o


def _launcher(req, sel, qa, ka, va, scale: float):
    """launch(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stream) for the selected candidate, its per-call work done
    once: for the cp.async / mma kernels the grid, block, shared memory and the size and stride arguments; for the
    TMA kernel a prepared parameter block (see launch.PreparedWs); for any other candidate its launch."""
    cand, kernels = sel.candidate, sel.kernels
    # Views without the arrays: a memoized plan must not keep the caller's tensors alive.
    qa, ka, va = qa.at(qa.ptr), ka.at(ka.ptr), va.at(va.ptr)
    if type(cand) is cands.Sm90Ws:
        prepared = PreparedWs(kernels[0], cand.tile(req), req.dtype("qkv"), qa, ka, va, scale)
        return prepared.launch
    if type(cand) in (cands.Sm90Wgmma, cands.Sm80Mma, cands.Simt):
        tile = cand.tile(req)
        b, sq, hq, d = qa.shape
        grid, block, smem = tile.grid(b, hq, sq), tile.threads, tile.smem_bytes(d)
        tail = kernel_args(qa, ka, va, 0, 0, scale)[5:]
        kl = kernels[0].launch

        def launch(qp, kp, vp, op, lp, stream):
            kl(grid, block, (qp, kp, vp, op, lp) + tail, shared_mem=smem, stream=stream)
        return launch

    def launch(qp, kp, vp, op, lp, stream):
        cand.launch(req, kernels, qa.at(qp), ka.at(kp), va.at(vp), op, lp, scale, stream)
    return launch
