"""Cross-entropy over rows of logits against integer labels, the loss of next-token prediction, forward and backward
in one pass each over the logits.

    loss, lse = rtckern.ops.cross_entropy(logits, labels)                # per row, fp32
    dlogits = rtckern.ops.cross_entropy_backward(dloss, logits, labels, lse)

loss = logsumexp(logits) - logits[label] for each row, without an fp32 copy of the logits or their log-softmax: the
logits are read once forward and once backward (torch's eager loss on bf16 logits upcasts them and writes the
log-softmax, each pass a full-size array). Logits fp32 / fp16 / bf16 with strided rows (the last dimension contiguous),
labels int64 or int32. rtckern.torch.cross_entropy adds the reductions and autograd. Torch tensors in give torch
tensors out, CuPy arrays give CuPy arrays (torch tensors take the memoized fast path).
"""
from __future__ import annotations

import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.dtypes import describe
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from .._common import tensor_signature as _sig
from . import candidates as cands
from . import geometry, plan

__all__ = ("cross_entropy", "cross_entropy_backward")

cands.register_all()


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "none"):
    """Cross-entropy of each row of logits against its label: loss = lse - logits[label], lse = log(sum(exp(logits))),
    and with reduction "mean" or "sum" their mean or sum, taken on the GPU.

    Args:
        logits: (..., N) torch CUDA tensor or CuPy array, fp32 / fp16 / bf16 (N: the vocabulary), rows strided or not
            (the last dimension contiguous; leading dimensions that flatten to one row stride).
        labels: (...), logits' shape without its last dimension, int64 or int32, any strides that flatten to one.
        ignore_index: rows whose label equals it get loss 0 (and gradient 0); default -100, as torch's.
        reduction: "none" (default), "mean" (over the rows whose label is not ignore_index; NaN over none, as torch)
            or "sum"; the reduction adds in fp64 in a fixed order (the same bits every run).

    Returns:
        "none": (loss, lse), fp32 arrays of labels' shape, contiguous. "mean" / "sum": (loss, lse, count): loss and
        count 0-d fp32 (count: the rows not ignored, which cross_entropy_backward takes for a mean's gradient). A
        label outside [0, N) that is not ignore_index gives a NaN loss (the kernel does not stop the GPU as torch's
        device assert does).

    Raises:
        InputError: host memory, a dtype it does not take, shapes that do not match, a strided last dimension,
            ignore_index not an int, a reduction it does not know.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    if reduction not in geometry.REDUCTIONS:
        raise InputError(f"reduction={reduction!r}; supported: {', '.join(geometry.REDUCTIONS)}")
    return _call((logits, labels), ignore_index, False, reduction)


def cross_entropy_backward(dloss, logits, labels, lse, ignore_index: int = -100, count=None):
    """The gradient of the losses with respect to the logits: dlogits = g * (softmax(logits) - onehot(label)) per
    row, with g the row's dloss (divided by count for a mean), 0 for rows whose label is ignore_index.

    Args:
        dloss: fp32, the gradient of each row's loss (labels' shape; any strides that flatten to one, 0 included), or
            one element (0-d or shape (1,)): the gradient of a sum or, with count, of a mean, taken by every row.
        logits, labels, ignore_index: the forward's.
        lse: what cross_entropy returned (fp32, labels' shape, contiguous).
        count: for a mean's gradient, the count cross_entropy(..., reduction="mean") returned (fp32, one element):
            each row's gradient is dloss / count; None otherwise.

    Returns:
        dlogits: logits' shape and dtype, contiguous.

    Raises:
        InputError: as cross_entropy's, and dloss, lse or count of another shape or dtype.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    return _call((dloss, logits, labels, lse, count), ignore_index, True, "none")[0]


def _call(args: tuple, ignore_index, backward: bool, reduction: str):
    torch = sys.modules.get("torch")
    key = None
    if torch is not None and type(ignore_index) is int \
            and all(a is None or type(a) in (torch.Tensor, torch.nn.Parameter) for a in args):
        key = (backward, ignore_index, reduction, *(_sig(a) for a in args))
        p = plan.plans.get(key)
        if p is not None and p.settings is config.settings():
            return p.run(tuple(0 if a is None else a.data_ptr() for a in args))
    names = ("dloss", "logits", "labels", "lse", "count") if backward else ("logits", "labels")
    wrapped = [None if a is None else arr.wrap(a, name) for a, name in zip(args, names)]
    p = _build(wrapped, ignore_index, backward, reduction)
    if key is not None:
        plan.plans.put(key, p)
    return p.run(tuple(0 if a is None else a.ptr for a in wrapped))


def flat_stride(a: arr.DeviceArray, name: str) -> int:
    """The one element stride that walks `a` row by row (0 for a broadcast value), or an InputError."""
    stride = arr.flat_stride(a.shape, a.strides)
    if stride is None:
        raise InputError(f"{name} of shape {a.shape} has strides {a.strides} (elements) that do not flatten to "
                         f"one stride; pass {name}.contiguous()")
    return stride


def _one_element(a: arr.DeviceArray) -> bool:
    n = 1
    for sz in a.shape:
        n *= sz
    return n == 1


def _build(wrapped: list, ignore_index, backward: bool, reduction: str) -> plan.CePlan:
    """The plan of a call whose wrapped arrays (argument order, None for an absent one) are `wrapped`."""
    settings = config.settings()
    if type(ignore_index) is not int:
        raise InputError(f"ignore_index={ignore_index!r} ({type(ignore_index).__name__}); pass an int such as -100")
    if not -2**63 <= ignore_index < 2**63:
        raise InputError(f"ignore_index={ignore_index} does not fit in int64; pass a value in [-2**63, 2**63), "
                         "such as -100")
    dloss, logits, labels, lse, count = wrapped if backward else (None, *wrapped, None, None)
    x = arr.rows(logits, "logits")
    if x.dtype not in geometry.DTYPES:
        raise InputError(f"logits is {x.dtype}; cross_entropy takes {describe(geometry.DTYPES)}")
    if x.n < 1:
        raise InputError(f"logits has shape {x.shape}: its last dimension (the classes) must not be empty")
    row_shape = x.shape[:-1]
    if labels.dtype not in geometry.LABEL_DTYPES:
        raise InputError(f"labels is {labels.dtype}; cross_entropy takes {describe(geometry.LABEL_DTYPES)} labels: "
                         "pass labels.long()")
    if labels.shape != row_shape:
        raise InputError(f"labels has shape {labels.shape}; it must be logits' shape without the last dimension, "
                         f"{row_shape}")
    arr.check_same_place(x, labels, "logits", "labels")
    label_stride = flat_stride(labels, "labels")
    for a, name, shapes in ((dloss, "dloss", f"labels' shape {row_shape} or one element"),
                            (lse, "lse", f"labels' shape {row_shape}"), (count, "count", "one element")):
        if a is None:
            continue
        fits = (a.shape == row_shape and name != "count") or (_one_element(a) and name != "lse")
        if a.dtype != "fp32" or not fits:
            raise InputError(f"{name} is {a.dtype} {a.shape}; it must be fp32 of {shapes}")
        arr.check_same_place(x, a, "logits", name)
    if lse is not None and x.rows > 1 and flat_stride(lse, "lse") != 1:
        raise InputError(f"lse of shape {lse.shape} has strides {lse.strides}; pass the contiguous lse that "
                         "cross_entropy returned")
    rows, n = x.rows, x.n
    if rows > geometry.MAX_ROWS:
        raise InputError(f"{rows} rows of logits; cross_entropy takes at most {geometry.MAX_ROWS} per call: split the "
                         "rows over several calls")
    reduce = reduction != "none"
    if backward:
        outs, returned = ((x.shape, x.dtype),), 1
    elif reduce:  # loss, lse, count, and the per-row losses the reduction reads
        outs, returned = (((), "fp32"), (row_shape, "fp32"), ((), "fp32"), (row_shape, "fp32")), 3
    else:
        outs, returned = ((row_shape, "fp32"), (row_shape, "fp32")), 2
    if rows == 0 and not reduce:
        return plan.CePlan(settings, x, outs, returned, (), "")
    out_rs = (n,) if backward else ()
    vec = geometry.vector_width(x.dtype, n, (x.ptr,), (x.row_stride,) + out_rs)
    kern = geometry.kernel(x.dtype, labels.dtype, vec, n, backward, reduce)
    sel = cands.selection(kern, n, DeviceInfo.from_device(x.device), x.device)
    steps = []
    if backward:  # dloss, x, labels, lse, count (None: a null pointer), dx
        d_stride = 0 if _one_element(dloss) else flat_stride(dloss, "dloss")
        go = sel.kernels[0].prepare(geometry.bwd_grid(rows, n, vec), (kern.threads, 1, 1), geometry.BWD_KINDS, 0)
        steps.append((go, (0, 1, 2, 3, None if count is None else 4, 5),
                      (rows, n, d_stride, x.row_stride, label_stride, n, ignore_index)))
    else:  # inputs x 0, labels 1; outputs loss 2, lse 3 (and count 4, per-row losses 5 with a reduction)
        if rows:
            go = sel.kernels[0].prepare((rows, 1, 1), (kern.threads, 1, 1), geometry.FWD_KINDS, 0)
            steps.append((go, (0, 1, 5 if reduce else 2, 3), (n, x.row_stride, label_stride, ignore_index)))
        if reduce:
            go = sel.kernels[1].prepare((1, 1, 1), (geometry.REDUCE_THREADS, 1, 1), geometry.REDUCE_KINDS, 0)
            steps.append((go, (5, 1, 2, 4), (rows, label_stride, ignore_index, int(reduction == "mean"))))
    return plan.CePlan(settings, x, outs, returned, tuple(steps), sel.candidate.name)
