import types

import numpy as np
import pytest

from rtckern.errors import InputError
from rtckern.runtime import arrays as A
from rtckern.runtime.arrays import convert_args, device_pointer
from rtckern.runtime.streams import stream_handle


class FakeCAI:
    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "typestr": "<f4", "version": 3}


def test_cuda_array_interface_pointer():
    assert device_pointer(FakeCAI(0xDEAD00)) == 0xDEAD00


def test_scalars_pass_through_and_arrays_convert():
    args, stream = convert_args((1, np.float32(2.0), FakeCAI(4096), np.int64(7)))
    assert args == (1, np.float32(2.0), 4096, np.int64(7)) and stream is None


def test_host_torch_tensor_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"torch tensor on cpu is in host memory; move it to the GPU"):
        device_pointer(torch.zeros(3))


def test_host_dlpack_refused():
    with pytest.raises(TypeError, match="not a CUDA device"):
        device_pointer(np.zeros(3))  # numpy speaks DLPack, on the CPU


def test_unknown_argument_type():
    with pytest.raises(TypeError, match="kernel argument of type str is not an int"):
        device_pointer("ptr")


def test_stream_handles():
    class S:
        def __cuda_stream__(self):
            return (0, 1234)

    class T:
        cuda_stream = 99

    assert stream_handle(5) == 5 and stream_handle(S()) == 1234 and stream_handle(T()) == 99
    with pytest.raises(TypeError, match="cannot use str as a stream"):
        stream_handle("default")


# ---- DeviceArray: one reading of every array, the same lines for every op -------------------------------------
class FakeDLPack:
    def __init__(self, dev_type):
        self.dev_type = dev_type

    def __dlpack__(self, stream=None):
        raise AssertionError("a refused array is not read")

    def __dlpack_device__(self):
        return (self.dev_type, 0)


def fake_cuda_tensor(torch, shape, strides, dtype, ptr=1 << 20, index=1):
    """What wrap reads of a CUDA torch tensor, without a GPU."""
    t = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=index), shape=shape, dtype=dtype)
    t.data_ptr, t.stride, t.element_size = (lambda: ptr), (lambda: strides), (lambda: dtype.itemsize)
    return t


def test_wrap_reads_torch_metadata():
    torch = pytest.importorskip("torch")
    a = A._from_torch(fake_cuda_tensor(torch, (4, 8), (16, 1), torch.bfloat16), "x")
    assert (a.lib, a.ptr, a.shape, a.strides, a.dtype, a.itemsize, a.device) == \
        ("torch", 1 << 20, (4, 8), (16, 1), "bf16", 2, 1)
    assert a.ndim == 2 and a.numel == 32 and not a.contiguous
    assert A._from_torch(fake_cuda_tensor(torch, (2, 3), (3, 1), torch.float64), "x").dtype == "float64"
    assert A._from_torch(fake_cuda_tensor(torch, (2, 3), (3, 1), torch.bool), "m").dtype == "bool"


def test_host_memory_is_refused_with_one_line():
    with pytest.raises(InputError, match=r"^x is a numpy array, in host memory; rtckern kernels read GPU memory: "
                                         r"pass a torch CUDA tensor or a CuPy array \(cupy.asarray\(x\)\)$"):
        A.wrap(np.ones(3), "x")
    torch = pytest.importorskip("torch")
    with pytest.raises(InputError, match=r"^w is on cpu, in host memory; rtckern kernels read GPU memory: move it "
                                         r"to the GPU \(w.cuda\(\)\)$"):
        A.wrap(torch.ones(3), "w")
    with pytest.raises(InputError, match=r"^w is on meta, not on a CUDA GPU; rtckern kernels read GPU memory"):
        A.wrap(torch.ones(3, device="meta"), "w")


@pytest.mark.parametrize("dev_type,label", [(1, "kDLCPU"), (3, "kDLCUDAHost"), (99, "unknown")])
def test_non_gpu_dlpack_devices_are_refused(dev_type, label):
    with pytest.raises(InputError, match=rf"^q \(FakeDLPack\) lives on DLPack device type {dev_type} \({label}\), "
                                         r"not in GPU memory; move it to the GPU first$"):
        A.wrap(FakeDLPack(dev_type), "q")


def test_unknown_types_are_refused():
    with pytest.raises(InputError, match=r"^a has type list; pass a torch CUDA tensor, a CuPy array, or an object "
                                         r"with __cuda_array_interface__ or __dlpack__$"):
        A.wrap([1.0], "a")


def arr(shape, strides=None, dtype="bf16", lib="torch", device=0, ptr=1 << 20):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return A.DeviceArray(None, lib, ptr, tuple(shape), tuple(strides), dtype, 2, device)


def test_contiguity_ignores_size_one_dims():
    assert arr((4, 8)).contiguous and arr((1, 8), (999, 1)).contiguous and arr((0, 8), (1, 5)).contiguous
    assert not arr((4, 8), (1, 4)).contiguous and not arr((4, 8), (16, 1)).contiguous
    t = arr((2, 4, 8)).transpose_last()
    assert (t.shape, t.strides) == ((2, 8, 4), (32, 1, 8))


def test_checks_name_the_value_and_the_fix():
    with pytest.raises(InputError, match=r"^x has dtype int32; supported: fp32, fp16, bf16 \(float32, float16, "
                                         r"bfloat16\): convert with x.to\(torch.float32\)$"):
        A.check_dtype(arr((4,), dtype="int32"), "x", ("fp32", "fp16", "bf16"))
    with pytest.raises(InputError, match=r"^q has dtype fp32; supported: bf16, fp16 \(bfloat16, float16\): "
                                         r"convert with q.astype\(cupy.bfloat16\)$"):
        A.check_dtype(arr((4,), dtype="fp32", lib="cupy"), "q", ("bf16", "fp16"))
    with pytest.raises(InputError, match=r"^x of shape \(4, 8\) is not contiguous; the kernels need contiguous rows: "
                                         r"pass x.contiguous\(\) \(torch\) or cupy.ascontiguousarray\(x\)$"):
        A.check_contiguous(arr((4, 8), (16, 1)), "x")
    with pytest.raises(InputError, match=r"^x is a torch array but mask a cupy array; pass arrays of one library$"):
        A.check_same_place(arr((4,)), arr((4,), lib="cupy"), "x", "mask")
    with pytest.raises(InputError, match=r"^x is on cuda:0 but mask on cuda:1; put both on one device$"):
        A.check_same_place(arr((4,)), arr((4,), device=1), "x", "mask")


def test_rows_view_of_strided_arrays():
    r = A.rows(arr((4, 3, 64), (3 * 128, 128, 1)), "x")
    assert (r.rows, r.n, r.row_stride, r.shape, r.dtype) == (12, 64, 128, (4, 3, 64), "bf16")
    r = A.rows(arr((1, 5, 64), (999, 64, 1)), "x")  # size-1 dimensions do not matter
    assert (r.rows, r.row_stride) == (5, 64)
    with pytest.raises(InputError, match=r"^x has stride 2 in its last dimension \(shape \(4, 64\)\); the kernels "
                                         r"need contiguous rows"):
        A.rows(arr((4, 64), (128, 2)), "x")
    with pytest.raises(InputError, match=r"leading dimensions do not flatten to \[rows, 64\] with one row stride"):
        A.rows(arr((2, 3, 64), (64, 128, 1)), "x")
    with pytest.raises(InputError, match=r"row stride 32 < 64: rows overlap"):
        A.rows(arr((4, 64), (32, 1)), "x")
    with pytest.raises(InputError, match=r"^x is a 0-d array"):
        A.rows(arr(()), "x")


def test_batched_matrix_view():
    assert A.batched_matrix(arr((4, 16), (32, 1))) == (32, 0, 1)
    assert A.batched_matrix(arr((3, 4, 16))) == (16, 64, 3)
    assert A.batched_matrix(arr((1, 16), (7, 1))) == (16, 0, 1)  # one row: its stride does not matter


def test_allocation_like_a_torch_input():
    torch = pytest.importorskip("torch")
    like = A.DeviceArray(torch.ones(1), "torch", 0, (1,), (1,), "fp32", 4, 0)  # a CPU tensor posing as a GPU one
    out, ptr = A.empty(like, (2, 3), "bf16")
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3) and ptr == out.data_ptr()
    out, _ = A.zeros(like, (5,), "int32")
    assert out.dtype == torch.int32 and not out.any()
    ws, _ = A.workspace(like, 10)
    assert ws.dtype == torch.float32 and ws.numel() == 3
