"""The `rtckern` torch.library namespace: the ops carrying kernels (`kernel_op`), the composite ops
(`define_composite`), and shared helpers for their fake kernels.

Registration, chosen by host cost per call (CPU, trivial kernel; docs/performance.md, Torch plugin): a
torch.library.custom_op call crosses three Python kernels (its autograd kernel, a redispatch, its backend
wrapper with an aliasing check); a composite in front of it adds a fourth. Here each op is defined with
torch.library.Library: its implementation is the backend kernel (CompositeExplicitAutograd), a fake kernel
serves FakeTensorMode / torch.compile / export, and a Python kernel at the Autograd key runs the implementation
itself when nothing traces or intercepts the call (`direct`), wrapping it in an autograd.Function only when a
gradient is needed. Under tracing, modes, subclasses, functorch transforms and meta tensors it redispatches as
custom_op does, so the tracer sees the op and its fake kernel. An eager call is one Python kernel.
"""
from __future__ import annotations

import functools
import importlib

import torch

from rtckern.errors import InputError

NAMESPACE = "rtckern"
# Ops defined here by schema and implemented as CompositeImplicitAutograd: they decompose (under autograd,
# torch.compile and export) into the custom ops that carry the kernels and the autograd formulas.
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
QUALIFIED = NAMESPACE + "::"

F32 = torch.float32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_transforms = torch._C._are_functorch_transforms_active
_grad_enabled = torch._C.is_grad_enabled
_inference = torch.is_inference_mode_enabled  # inference mode takes the autograd keys away, grad mode or not
_any_requires_grad = torch._C._any_requires_grad
_below_autograd = torch._C._AutoDispatchBelowAutograd
_after_autograd = torch._C._after_autograd_keyset


# What _torch_native may serve natively: the kernel ops that write no argument, and the composites with their
# eager paths, by name.
KERNEL_OPS: dict[str, "KernelOp"] = {}
COMPOSITE_DIRECT: dict[str, object] = {}
COMPOSITE_FN: dict[str, object] = {}  # the composites' own functions


def define_composite(schema: str, fn, direct=None) -> None:
    """An op that decomposes into the kernel ops under autograd, torch.compile and export; fn starts with an
    eager fast path (`direct`) where it can. direct: that path as a function of every argument (defaults filled in)
    for plain eager calls, which the native front records (_torch_native)."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, fn, "CompositeImplicitAutograd")
    if direct is not None:
        COMPOSITE_DIRECT[name] = direct
        COMPOSITE_FN[name] = fn


# ---- the eager fast path inside the dispatcher ------------------------------------------------------------------
_function_modes = torch._C._is_torch_function_mode_enabled
_compiling = torch.compiler.is_compiling  # dynamo (compiled autograd included) must see the op, not its body
_function_apply = torch._C._FunctionBase.__dict__["apply"]  # the C++ apply, bound per Function class below


def _plain(args: tuple, tensor_args: tuple[int, ...]) -> bool:
    """`direct` over the tensor arguments at positions tensor_args (this runs on every eager call)."""
    if _dispatch_modes() or _transforms():
        return False
    n = len(args)
    for i in tensor_args:
        t = args[i] if i < n else None
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


def direct(*tensors) -> bool:
    """True when a kernel at the autograd level may run the implementation itself, i.e. do what the redispatch
    to the backend kernel would do: no dispatch mode (FakeTensorMode, make_fx, functionalization, a user's
    TorchDispatchMode), no functorch transform, and plain dense tensors (no subclass such as FakeTensor or
    DTensor, no meta tensor, whose kernel is the fake one). Torch-function modes have already seen the call."""
    if _dispatch_modes() or _transforms():
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


class KernelOp:
    """An op carrying a kernel, registered with torch.library.Library (module docstring): the drop-in for
    torch.library.custom_op that rtckern's ops use.

        @kernel_op("softmax")
        def softmax(x: Tensor, scale: float = 1.0) -> Tensor: ...   # the implementation; schema from annotations
        softmax.register_fake(fake)
        softmax.register_autograd(backward, setup_context=setup)     # custom_op's conventions

    mutates_args names the arguments the implementation may write in place, as for custom_op (the schema marks them
    `Tensor(a!)`, so functionalization and torch.compile see the writes). Calling the object calls
    torch.ops.rtckern.<name>, or its implementation directly in plain eager code; `call_direct` is for callers that
    have checked `direct` themselves (the composites' fast paths)."""

    def __init__(self, name: str, fn, mutates_args: tuple[str, ...] = ()) -> None:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        LIB.define(name + schema)
        self.name, self.fn = name, fn
        self.op = getattr(getattr(torch.ops, NAMESPACE), name).default
        args = self.op._schema.arguments
        self._defaults = tuple(a.default_value for a in args)
        self._tensor_args = tuple(i for i, a in enumerate(args) if str(a.type) in ("Tensor", "Optional[Tensor]"))
        self._setup = self._backward = None
        self.native = False  # served by the native front (_torch_native): calls without a gradient go through it
        self.native_grad = False  # ... and calls needing one too (its C++ autograd node: the formula written there)
        self.function = self._autograd_function()
        # autograd.Function.apply without its Python wrapper, whose work (binding defaults for setup_context,
        # unwrapping dead functorch wrappers) has nothing to do on the eager fast path: ~4 us per call
        self._apply = _function_apply.__get__(None, self.function)
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        LIB.impl(name, self._autograd_kernel(), "Autograd", with_keyset=True)
        if not mutates_args:
            KERNEL_OPS[name] = self

    def __call__(self, *args, **kwargs):
        """torch.ops.rtckern.<name>(*args), taking the eager fast path (`call_direct`) itself when nothing traces
        or intercepts the call: the backward formulas call their backward ops this way. Where the native front serves
        the op, a call needing no gradient goes through the dispatcher to it (its replay costs less than the Python
        path; what it does not replay reaches the same Python kernels)."""
        if self.native and not kwargs and not _compiling() and (
                self.native_grad or not (_grad_enabled() and _any_requires_grad(*args))):
            return self.op(*args)
        if not kwargs and not _function_modes() and not _compiling() and _plain(args, self._tensor_args):
            return self.call_direct(*args)
        return self.op(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(QUALIFIED + self.name, fake, lib=LIB)
        return fake

    def register_autograd(self, backward, *, setup_context) -> None:
        """backward(ctx, *grads) -> one gradient (or None) per argument; setup_context(ctx, inputs, output) with
        every argument in inputs (defaults filled in), as torch.library.register_autograd."""
        self._backward, self._setup = backward, setup_context

    def call_direct(self, *args):
        """The op in plain eager code (the caller checked `direct`): the implementation, through the op's
        autograd.Function when a gradient is needed."""
        if _grad_enabled() and not _inference() and _any_requires_grad(*args):
            # the native front's C++ autograd node where it has the formula (what it declines comes back to the
            # Python autograd kernel, which applies the same Function as here)
            return self.op(*args) if self.native_grad else self._apply(*args, None)
        return self.fn(*args)

    def _autograd_kernel(self):
        fn, op, tensor_args, function, apply = self.fn, self.op, self._tensor_args, self.function, self._apply

        def autograd_kernel(keyset, *args):
            grad = _grad_enabled() and _any_requires_grad(*args)
            if _plain(args, tensor_args):
                return apply(*args, None) if grad else fn(*args)
            if grad:
                return function.apply(*args, keyset)
            with _below_autograd():
                return op.redispatch(keyset & _after_autograd, *args)

        autograd_kernel.__name__ = f"{self.name}_autograd"
        return autograd_kernel

    def _autograd_function(self) -> type:
        kop = self

        def forward(ctx, *args):
            keyset, args = args[-1], args[:-1]
            if keyset is None:  # plain eager: the implementation itself (replayed by the native front where it serves)
                out = kop.op(*args) if kop.native else kop.fn(*args)
            else:
                with _below_autograd():
                    out = kop.op.redispatch(keyset & _after_autograd, *args)
            if kop._setup is not None:
                kop._setup(ctx, args + kop._defaults[len(args):], out)
            return out

        def backward(ctx, *grads):
            if kop._backward is None:
                raise RuntimeError(f"rtckern::{kop.name} has no autograd formula (double backward through rtckern's "
                                   "backward ops is not supported)")
            wanted = ctx.needs_input_grad
            n = len(wanted) - 1  # the arguments the call passed (the dispatcher leaves out trailing defaults)
            ctx.needs_input_grad = wanted[:-1]  # the formula sees the op's arguments only, not the keyset
            try:
                g = kop._backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = wanted
            g = g if isinstance(g, tuple) else (g,)
            return (*g[:n], *(None,) * (n - len(g)), None)

        return type(f"{self.name}_function", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def kernel_op(name: str, mutates_args: tuple[str, ...] = ()):
    """Decorator: `@kernel_op("rms_norm_fwd")` over the implementation makes torch.ops.rtckern.rms_norm_fwd."""
    return lambda fn: KernelOp(name, fn, mutates_args)


def empty_stat(x: torch.Tensor) -> torch.Tensor:
    """Placeholder output for statistics not asked for: custom ops cannot return None."""
    return x.new_empty((0,), dtype=F32)


def placeholder(param, like: torch.Tensor) -> torch.Tensor:
    """Placeholder gradient output for a parameter that is absent or whose gradient was not asked for."""
    return like.new_empty((0,), dtype=param.dtype if param is not None else like.dtype)


def needs_grad(*tensors) -> bool:
    """A gradient will flow through the call: grad mode on outside inference mode (which drops the autograd keys
    even under enable_grad) and an argument requiring grad."""
    return _grad_enabled() and not _inference() and _any_requires_grad(*tensors)


def check_float(t: torch.Tensor, name: str, allowed=FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise InputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: {names}")


def check_vector(v, x: torch.Tensor, name: str) -> None:
    """A per-column parameter of a norm: shape (N,) for x of shape (..., N)."""
    if v is None:
        return
    if x.dim() == 0:
        raise InputError("x is a 0-d tensor; the norms normalize over the last dimension, so x needs at least one "
                         "dimension")
    if tuple(v.shape) != (x.shape[-1],):
        raise InputError(f"{name} has shape {tuple(v.shape)}; it must be ({x.shape[-1]},), the size of x's last "
                         f"dimension (x has shape {tuple(x.shape)})")


def check_same_shape(a: torch.Tensor, x: torch.Tensor, name: str, x_name: str = "x") -> None:
    if a.shape != x.shape:
        raise InputError(f"{name} has shape {tuple(a.shape)} but {x_name} has {tuple(x.shape)}; they must match")


@functools.cache
def ops_module(family: str):
    """The family's API module, rtckern.ops._<family>.api (its public ops and the *_impl entry points the custom
    ops call)."""
    return importlib.import_module(f"rtckern.ops._{family}.api")
