import numpy as np
import pytest

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
