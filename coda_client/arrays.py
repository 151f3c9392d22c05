"""A trajectory's numeric arrays between Python values and their packed wire runs, NumPy optional.

Encoding takes NumPy arrays (any numeric dtype that fits), lists, tuples, array.array or anything NumPy can
view (e.g. a CPU torch tensor), and gives a buffer the request is joined from; no per-number loop runs when
the values are already a buffer of the wire's dtype. Decoding gives read-only NumPy arrays over the received
bytes (`"numpy"`) or plain lists (`"list"`, the default of the plain client, which needs no NumPy).
"""
from __future__ import annotations

import array
import sys
from typing import Any, Literal

from . import wire_forms as _wire

ArrayMode = Literal["list", "numpy"]
ARRAY_MODES: tuple[str, ...] = ("list", "numpy")

NUMPY_HINT = "NumPy is needed for array results: pip install 'coda-pacer[numpy]'"
TORCH_HINT = "PyTorch is needed for tensors: install torch (it is never a dependency of coda-pacer)"

# array.array type code of each fixed-width dtype (sizes checked at import below).
_ARRAY_CODES = {"<i4": "i", "<u4": "I", "<f4": "f", "<i8": "q", "<u8": "Q", "<f8": "d"}
_BIG_ENDIAN = sys.byteorder == "big"
_INT32 = (-(2**31), 2**31 - 1)


def numpy() -> Any:
    """The numpy module, or ImportError saying how to install the extra."""
    try:
        import numpy as np
    except ImportError as exc:
        raise ImportError(NUMPY_HINT) from exc
    return np


def check_mode(mode: str) -> ArrayMode:
    """Validates an `arrays=` argument (and that NumPy is there when it is asked for)."""
    if mode not in ARRAY_MODES:
        raise ValueError(f"arrays must be 'list' or 'numpy', not {mode!r}")
    if mode == "numpy":
        numpy()
    return mode  # type: ignore[return-value]


def dtype_of(name: str) -> str:
    """Little-endian NumPy dtype of a trajectory array (e.g. '<i4' for token_ids)."""
    return _wire.DTYPES[name]


def encode(name: str, values: Any) -> Any:
    """The wire run of trajectory array `name` as a buffer of little-endian numbers of its wire type.

    Raises TypeError for values of the wrong kind (floats as token ids, a string) and ValueError for
    values that do not fit (outside int32, a 2-D array), naming the field.
    """
    dtype = dtype_of(name)
    if isinstance(values, (list, tuple, range, array.array)):
        return _encode_sequence(name, dtype, values)
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be a sequence or array of numbers, not {type(values).__name__}")
    return _encode_ndarray(name, dtype, numpy().asarray(values))


def _encode_sequence(name: str, dtype: str, values: Any) -> array.array:
    code = _ARRAY_CODES[dtype]
    if isinstance(values, array.array) and values.typecode == code and not _BIG_ENDIAN:
        return values
    try:
        run = array.array(code, values)
    except OverflowError:
        raise ValueError(f"{name} holds a number outside the range of its wire type {dtype[1:]}") from None
    except TypeError as exc:
        raise TypeError(f"{name} must hold numbers of its wire type {dtype[1:]}: {exc}") from None
    if _BIG_ENDIAN:  # protobuf's fixed-width numbers are little-endian on every platform
        run.byteswap()
    return run


def _encode_ndarray(name: str, dtype: str, values: Any) -> Any:
    np = numpy()
    if values.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {values.shape}")
    target = np.dtype(dtype)
    if values.dtype == target:
        return np.ascontiguousarray(values)
    kind = values.dtype.kind
    if target.kind == "f":
        if kind not in "fiub":
            raise TypeError(f"{name} must be numbers, got dtype {values.dtype}")
    else:
        if kind not in "iub":
            raise TypeError(f"{name} must be integers, got dtype {values.dtype}")
        limits = np.iinfo(target)
        if values.size and kind != "b" and (values.min() < limits.min or values.max() > limits.max):
            raise ValueError(f"{name} holds a number outside [{limits.min}, {limits.max}] (its wire type {dtype[1:]})")
    return np.ascontiguousarray(values, dtype=target)


def decode(name: str, run: bytes | memoryview, mode: ArrayMode) -> Any:
    """The values of one packed run: a read-only NumPy array over `run` itself, or a list."""
    dtype = dtype_of(name)
    if mode == "numpy":
        result = numpy().frombuffer(run, dtype=dtype)
        result.flags.writeable = False  # already so over bytes; also over a writable buffer
        return result
    values = array.array(_ARRAY_CODES[dtype])
    values.frombytes(run)
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tolist()


def from_values(name: str, values: Any, mode: ArrayMode) -> Any:
    """Decoded values (a protobuf repeated field, a list) in the shape `mode` asks for."""
    if mode == "list":
        return list(values)
    result = numpy().array(values, dtype=dtype_of(name))
    result.flags.writeable = False
    return result


def comparable(name: str, values: Any) -> bytes:
    """What equality of two trajectories compares: the encoded bit patterns of an array (so NaN logprobs
    compare equal to themselves, and a list equals the array of the same numbers)."""
    return bytes(memoryview(encode(name, values)).cast("B"))


def to_torch(values: Any, *, share_read_only: bool = False) -> Any:
    """A torch tensor over `values` (a NumPy array) through DLPack, without a copy when it is writable.

    A read-only array (a result's view over the received bytes) is copied: a tensor is always writable,
    and some NumPy/torch pairs (NumPy 2.3 with torch 2.13, for one) share a read-only array through DLPack
    anyway, so writing to the tensor would change the immutable bytes under the view. `share_read_only`
    is for arrays that own their memory and are read-only only to guard against slips (a MiniBatch's
    columns): they are shared where DLPack allows it.
    """
    try:
        import torch
    except ImportError as exc:
        raise ImportError(TORCH_HINT) from exc
    if not share_read_only and not getattr(getattr(values, "flags", None), "writeable", False):
        return torch.from_numpy(numpy().array(values))
    try:
        return torch.from_dlpack(values)
    except (BufferError, TypeError, RuntimeError):
        return torch.from_numpy(numpy().array(values))


for _dtype, _code in _ARRAY_CODES.items():
    assert array.array(_code).itemsize == int(_dtype[2:]), f"array.array({_code!r}) is not {_dtype[2:]} bytes here"
