"""Hostile pickles for the safe loader: numpy objects that would hold pointers, built by hand.

Each file is a pickle program written opcode by opcode (the way an attacker with write access to
the checkpoint directory writes it), put in a real torch zip, and loaded through every entry point
(``stagesave.load``, ``Checkpointer.load``, Lightning's ``StagedCheckpointIO.load_checkpoint``).
A load that would build an object array from raw bytes segfaults when the array is printed, so
every hostile load runs in a forked child: a crash is a test failure, not a dead pytest. The fuzz
test runs its whole hypothesis loop in one forked child for the same reason, writing each example
to a file before loading it so that a crash or a hang names its input.
"""

from __future__ import annotations

import importlib
import io
import json
import multiprocessing as mp
import os
import pickle
import struct
import time
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import faultstats
import numpy as np
import pytest
import torch
from pickleasm import (
    BUILD,
    EMPTY_TUPLE,
    FALSE,
    MARK,
    NONE,
    REDUCE,
    TRUE,
    TUPLE,
    TUPLE1,
    TUPLE2,
    TUPLE3,
    glob,
    num,
    raw,
    text,
    tup,
)

import stagesave
from stagesave.errors import CheckpointError

_MA = "numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray"
_multiarray: Any = importlib.import_module(_MA)


# ---------------------------------------------------------------------------- pickle assembly
def dtype_reduce(spec: str) -> bytes:
    return glob("numpy", "dtype") + text(spec) + FALSE + TRUE + TUPLE3 + REDUCE


def dtype_state(endian: str = "|", sub: bytes = NONE, names: bytes = NONE, fields: bytes = NONE,
                elsize: int = -1, align: int = -1, flags: int = 0) -> bytes:
    return tup(num(3), text(endian), sub, names, fields, num(elsize), num(align), num(flags))


def dtype(spec: str, endian: str = "<", **state: Any) -> bytes:
    """A dtype exactly as numpy pickles it: REDUCE of numpy.dtype, then BUILD with its state."""
    return dtype_reduce(spec) + dtype_state(endian, **state) + BUILD


def array(shape: tuple[int, ...], dtype_ops: bytes, data: bytes, *, module: str = _MA) -> bytes:
    """An array exactly as numpy pickles it: _reconstruct(ndarray, (0,), b'b'), then BUILD."""
    return (
        glob(module, "_reconstruct")
        + glob("numpy", "ndarray")
        + num(0)
        + TUPLE1
        + raw(b"b")
        + TUPLE3
        + REDUCE
        + tup(num(1), tup(*(num(n) for n in shape)), dtype_ops, FALSE, raw(data))
        + BUILD
    )


def program(value: bytes) -> bytes:
    """``{'x': value}`` as a complete protocol 2 pickle."""
    return b"\x80\x02}" + text("x") + value + b"s."


def torch_zip(path: Any, pkl: bytes) -> None:
    """A real torch zip (what torch.save writes) whose pickle is ``pkl``."""
    w = torch._C.PyTorchFileWriter(os.fspath(path))
    w.write_record("data.pkl", pkl, len(pkl))
    w.write_record("byteorder", b"little", 6)
    w.write_end_of_file()


# 0x41414141... as PyObject* addresses: printing an object array of these segfaults
POINTERS = b"A" * 16

#: name -> the hostile value (inside ``{'x': ...}``). Each is one route to an object array, an
#: unchecked dtype or memory that an array no longer owns.
HOSTILE: dict[str, bytes] = {
    # the reported file: dtype('O8') by REDUCE alone (no BUILD), given raw bytes as data
    "dtype_O8_reduce_without_build": array((2,), dtype_reduce("O8"), POINTERS),
    "dtype_O_reduce_and_build": array((2,), dtype("O", "|"), POINTERS),
    "structured_dtype_with_object_field_from_string": array((1,), dtype_reduce("f8,O"), POINTERS),
    "subarray_dtype_of_objects_from_string": array((1,), dtype_reduce("(2,)O"), POINTERS),
    # dtype.__setstate__: a void dtype given an object field through its state
    "structured_dtype_with_object_field_via_setstate": array(
        (1,),
        dtype_reduce("V16")
        + dtype_state(
            names=tup(text("a")),
            fields=b"}" + text("a") + tup(dtype_reduce("O8"), num(0)) + b"s",
            elsize=16,
            align=8,
            flags=63,
        )
        + BUILD,
        POINTERS,
    ),
    # dtype.__setstate__: flags claiming references on a void dtype
    "void_dtype_with_object_flags_via_setstate": array(
        (2,), dtype_reduce("V8") + dtype_state(elsize=8, align=1, flags=63) + BUILD, POINTERS
    ),
    # dtype.__setstate__ after an array was made: the item size grows under the array
    "dtype_setstate_after_use_grows_item_size": (
        dtype_reduce("V1")
        + dtype_state(elsize=1, align=1)
        + BUILD
        + b"q\x01"
        + tup(
            array((1,), b"h\x01", b"\x00"), b"h\x01" + dtype_state(elsize=1 << 24, align=1) + BUILD
        )
    ),
    # numpy.dtypes classes called by the file
    "dtypes_ObjectDType_reduce": array(
        (2,), glob("numpy.dtypes", "ObjectDType") + EMPTY_TUPLE + REDUCE, POINTERS
    ),
    "dtypes_ObjectDType_newobj": array(
        (2,), glob("numpy.dtypes", "ObjectDType") + EMPTY_TUPLE + b"\x81", POINTERS
    ),
    "StringDType_from_raw_bytes": array((1,), dtype("T", "|"), POINTERS),
    # _reconstruct asked for an object array directly
    "reconstruct_object_typecode": (
        glob(_MA, "_reconstruct")
        + glob("numpy", "ndarray")
        + num(2)
        + TUPLE1
        + raw(b"O")
        + TUPLE3
        + REDUCE
    ),
    "reconstruct_old_module_name": array(
        (2,), dtype_reduce("O8"), POINTERS, module="numpy.core.multiarray"
    ),
    # scalar(): an object scalar, and a void scalar with an object field, from raw bytes
    "scalar_of_object_dtype": glob(_MA, "scalar")
    + dtype_reduce("O8")
    + raw(b"A" * 8)
    + TUPLE2
    + REDUCE,
    "scalar_of_structured_object_dtype": (
        glob(_MA, "scalar") + dtype_reduce("O,O") + raw(POINTERS) + TUPLE2 + REDUCE
    ),
    # ndarray.__setstate__ twice, the second time after a tensor shares the first buffer
    "array_setstate_twice_under_a_shared_tensor": (
        array((4,), dtype("f4"), b"\x00" * 16)
        + b"q\x01"
        + tup(
            glob("torch._utils", "_rebuild_device_tensor_from_numpy")
            + tup(b"h\x01", glob("torch", "float32"), text("cpu"), FALSE)
            + REDUCE,
            b"h\x01" + tup(num(1), tup(num(1 << 20)), dtype("f4"), FALSE, raw(b"\x00" * 8)) + BUILD,
        )
    ),
    # torch's tensor-subclass rebuild calls its first argument: make it call numpy.dtype('O')
    "rebuild_from_type_v2_calls_numpy": array(
        (2,),
        glob("torch._tensor", "_rebuild_from_type_v2")
        + tup(
            glob("numpy", "dtype"),
            glob("numpy.dtypes", "ObjectDType"),
            tup(text("O")),
            dtype_state(flags=63),
        )
        + REDUCE,
        POINTERS,
    ),
    # numpy.ndarray called by the file: an array over another object's memory
    "ndarray_called_directly": (
        glob("numpy", "ndarray") + tup(tup(num(2)), dtype("f8"), raw(POINTERS)) + REDUCE
    ),
    # an allocation bomb through builtins (not a pointer, but the loader must not run it)
    "bytearray_of_a_huge_length": glob("builtins", "bytearray") + num(1 << 28) + TUPLE1 + REDUCE,
}

#: what each refusal must name
NAMES: dict[str, str] = {
    "dtype_O8_reduce_without_build": "dtype('O')",
    "dtype_O_reduce_and_build": "dtype('O')",
    "structured_dtype_with_object_field_from_string": "'f8,O'",
    "subarray_dtype_of_objects_from_string": "'(2,)O'",
    "structured_dtype_with_object_field_via_setstate": "dtype('O')",
    "void_dtype_with_object_flags_via_setstate": "flags 0x3f",
    "dtype_setstate_after_use_grows_item_size": "state of a numpy VoidDType",
    "dtypes_ObjectDType_reduce": "numpy.dtypes.ObjectDType",
    "dtypes_ObjectDType_newobj": "numpy.dtypes.ObjectDType",
    "StringDType_from_raw_bytes": "StringDType",
    "reconstruct_object_typecode": "_reconstruct",
    "reconstruct_old_module_name": "dtype('O')",
    "scalar_of_object_dtype": "dtype('O')",
    "scalar_of_structured_object_dtype": "'O,O'",
    "array_setstate_twice_under_a_shared_tensor": "state of a numpy ndarray",
    "rebuild_from_type_v2_calls_numpy": "_rebuild_from_type_v2",
    "ndarray_called_directly": "numpy.ndarray",
    "bytearray_of_a_huge_length": "builtins.bytearray",
}


def _entry(kind: str) -> Callable[[str], Any]:
    if kind == "load":
        return lambda p: stagesave.load(p)
    if kind == "checkpointer":
        def load(p: str) -> Any:
            with stagesave.Checkpointer(os.path.dirname(p)) as ck:
                return ck.load(os.path.basename(p))
        return load
    from stagesave.lightning import StagedCheckpointIO

    return lambda p: StagedCheckpointIO().load_checkpoint(p)


def _violations(obj: Any) -> list[str]:
    """What in a loaded object holds pointers or is not a plain type."""
    out: list[str] = []
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, np.ndarray) and (x.dtype.hasobject or x.dtype.kind not in "biufcSUVMm"):
            out.append(f"array of dtype {x.dtype!r}")
        elif isinstance(x, np.generic) and (x.dtype.hasobject or x.dtype.kind not in "biufcSUVMm"):
            out.append(f"scalar of dtype {x.dtype!r}")
        elif isinstance(x, np.dtype) and (x.hasobject or x.kind not in "biufcSUVMm"):
            out.append(f"dtype {x!r}")
        elif isinstance(x, (dict, OrderedDict, Counter)):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                walk(v)

    walk(obj)
    return out


def _child(conn: Any, kind: str, path: str) -> None:
    try:
        result = _entry(kind)(path)
        text_ = repr(result)  # what the user does next; segfaults on forged PyObject* pointers
        conn.send(("loaded", _violations(result), text_[:200]))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which judges it
        conn.send(("raised", [c.__name__ for c in type(exc).__mro__], f"{exc}"[:2000]))
    conn.close()
    os._exit(0)


def _receive(conn: Any, timeout: float) -> Any:
    """What the child sent, or None if it died (EOF) or did not answer in time."""
    try:
        return conn.recv() if conn.poll(timeout) else None
    except EOFError:
        return None


def run_in_child(kind: str, path: Any, timeout: float = 120) -> tuple[Any, ...]:
    """The outcome of one load in a forked child; a crash or hang is reported, not suffered."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, kind, os.fspath(path)))
    p.start()
    child.close()
    got = _receive(parent, timeout)
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    if got is None:
        return ("died", p.exitcode)
    return tuple(got)


ENTRIES = ["load", "checkpointer", "lightning"]


@pytest.mark.fault_class("hostile pickle: numpy object/pointer routes")
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_numpy_pickle_is_refused_by_every_entry_point(tmp_path, name):
    path = tmp_path / f"{name}.ckpt"
    torch_zip(path, program(HOSTILE[name]))
    for kind in ENTRIES:
        outcome = run_in_child(kind, path)
        assert outcome[0] != "died", f"{kind}: the loading process died (exit {outcome[1]})"
        assert outcome[0] == "raised", f"{kind}: loaded {outcome[2]!r} (violations: {outcome[1]})"
        mro, message = outcome[1], outcome[2]
        # refused as unsafe, naming what (not merely "damaged" because numpy happened to object)
        assert "UnsafeCheckpointError" in mro, f"{kind}: raised {mro[0]}, not a refusal: {message}"
        assert "refusing to load" in message and "trusted=True" in message, message
        assert NAMES[name] in message, f"{kind}: the refusal does not name {NAMES[name]}: {message}"


def test_refusal_names_what_was_refused(tmp_path):
    """The message says it is an object dtype, and what to do (trusted=True)."""
    path = tmp_path / "o8.ckpt"
    torch_zip(path, program(HOSTILE["dtype_O8_reduce_without_build"]))
    outcome = run_in_child("load", path)
    assert outcome[0] == "raised" and "UnsafeCheckpointError" in outcome[1], outcome
    assert "dtype('O')" in outcome[2] and "object" in outcome[2] and "trusted=True" in outcome[2]


class _ObjectDtype:
    """Pickles as ``numpy.dtype('O8', False, True)`` with a state whose flags omit numpy's
    "pickled as a list" bit, so that numpy takes raw bytes as the array's data."""

    def __reduce__(self) -> Any:
        return (np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, 0))


class _PointerArray:
    """Pickles as numpy's own array pickle, with the object dtype above and raw bytes as data."""

    def __reduce__(self) -> Any:
        return (
            _multiarray._reconstruct,
            (np.ndarray, (0,), b"b"),
            (1, (2,), _ObjectDtype(), False, POINTERS),
        )


@pytest.mark.fault_class("hostile pickle: numpy object/pointer routes")
def test_pointer_array_inside_a_verified_stagesave_checkpoint_is_refused(tmp_path):
    """A checkpoint whose proof is valid (written by stagesave.save) is refused all the same."""
    path = tmp_path / "signed.ckpt"
    stagesave.save({"w": torch.ones(2), "x": _PointerArray()}, path)
    assert stagesave.verify(path).status in ("verified", "committed")
    for kind in ENTRIES:
        outcome = run_in_child(kind, path)
        assert outcome[0] == "raised" and "UnsafeCheckpointError" in outcome[1], (kind, outcome)


# ---------------------------------------------------------------------------- legit numpy loads
LEGIT: list[Any] = [
    np.arange(12, dtype=np.int64).reshape(3, 4),
    np.linspace(0, 1, 7, dtype=np.float32),
    np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)),
    np.array([True, False]),
    np.array([1 + 2j], dtype=np.complex64),
    np.array([b"ab", b"c"]),
    np.array(["hé", "x"]),
    np.zeros(0, dtype=np.float16),
    np.array(["2020-01-01T00:00"], dtype="datetime64[10ns]"),
    np.array([1, 2], dtype="timedelta64[s]"),
    np.zeros(2, dtype=[("a", "<f4"), ("b", "i1", (2,))]),
    np.zeros(2, dtype=np.dtype([("a", "<f4"), ("b", "i1", (2,))], align=True)),
    np.zeros(
        1,
        dtype=np.dtype(
            {"names": ["x"], "formats": ["u1"], "offsets": [4], "titles": ["T"], "itemsize": 8}
        ),
    ),
    np.zeros(3, dtype="V5"),
    np.array(["", ""]),
    np.zeros((2, 0)),
    np.float64(1.5),
    np.int8(-3),
    np.bool_(True),
    np.datetime64("2020-01-01"),
    np.str_("s"),
    np.str_(""),
    np.bytes_(b""),
    np.void(b"\x01\x02"),
    np.dtype("f8"),
    np.dtype(">u2"),
    np.dtype(("f8", (2, 3))),
    np.random.get_state(),
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes(order="A") == b.tobytes(order="A")
            and a.flags.f_contiguous == b.flags.f_contiguous
        )
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("kind", ENTRIES)
def test_numeric_numpy_arrays_and_scalars_still_load_bytes_equal(tmp_path, kind):
    plain, saved = tmp_path / "plain.ckpt", tmp_path / "saved.ckpt"
    state = {f"v{i}": v for i, v in enumerate(LEGIT)} | {"t": torch.arange(3.0)}
    torch.save(state, plain)
    stagesave.save(state, saved)
    for path in (plain, saved):
        loaded = _entry(kind)(os.fspath(path))
        for key, value in state.items():
            if key == "t":
                assert torch.equal(loaded[key], value)
            else:  # exactly what the full unpickler makes of it (numpy may normalise byte order)
                expected = pickle.loads(pickle.dumps(value, 2))
                assert _same(expected, loaded[key]), (key, expected, loaded[key])


# ---------------------------------------------------------------------------- the fuzz
#: the allow-listed globals (and a few refused ones) the fuzz names
_FUZZ_GLOBALS = [
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    (_MA, "_reconstruct"),
    (_MA, "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.dtypes", "ObjectDType"),
    ("numpy.dtypes", "Float64DType"),
    ("numpy.dtypes", "StringDType"),
    ("numpy.dtypes", "VoidDType"),
    ("builtins", "bytes"),
    ("builtins", "bytearray"),
    ("builtins", "set"),
    ("builtins", "complex"),
    ("_codecs", "encode"),
    ("collections", "OrderedDict"),
    ("collections", "Counter"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "device"),
    ("torch.nn.parameter", "Parameter"),
    ("builtins", "eval"),
    ("numpy", "frombuffer"),
]
_FUZZ_TEXT = [
    "O8",
    "O",
    "f8",
    "<f4",
    "V8",
    "V16",
    "T",
    "U3",
    "S2",
    "M8",
    "f8,O",
    "(2,)O",
    "i1,i1",
    "b",
    "latin1",
    "utf-8",
    "zlib",
    "<",
    "|",
    ">",
    "cpu",
    "a",
    "storage",
    "\x00",
]


def _fuzz_programs() -> Any:
    from hypothesis import strategies as st

    glob_ = st.sampled_from(_FUZZ_GLOBALS).map(lambda g: glob(*g))
    small = st.one_of(
        st.integers(-3, 300).map(num),
        st.sampled_from(_FUZZ_TEXT).map(text),
        st.binary(max_size=24).map(raw),
        st.sampled_from([NONE, TRUE, FALSE, EMPTY_TUPLE, b"]", b"}", b"\x8f"]),
        st.floats(allow_nan=True).map(lambda f: b"G" + struct.pack(">d", f)),
        st.integers(0, 2**70).map(
            lambda n: b"\x8a" + bytes([len(pickle.encode_long(n))]) + pickle.encode_long(n)
        ),
    )
    # whole numpy constructions, legit and hostile, so the fuzz gets past the first checks
    made = st.one_of(
        st.tuples(st.sampled_from(_FUZZ_TEXT), st.sampled_from(["<", "|", ">"])).map(
            lambda t: dtype(*t)
        ),
        st.sampled_from(_FUZZ_TEXT).map(dtype_reduce),
        st.tuples(
            st.lists(st.integers(0, 3), max_size=3),
            st.sampled_from(["f8", "O", "V2", "i1,i1", "U1"]),
            st.binary(max_size=48),
        ).map(lambda t: array(tuple(t[0]), dtype(t[1], "|"), t[2])),
        st.sampled_from(list(HOSTILE.values())),
    )
    op = st.one_of(
        glob_,
        small,
        made,
        st.sampled_from(
            [
                MARK,
                TUPLE,
                TUPLE1,
                TUPLE2,
                TUPLE3,
                REDUCE,
                BUILD,
                b"\x81",
                b"a",
                b"e",
                b"s",
                b"u",
                b"Q",
            ]
        ),
        st.integers(0, 4).map(lambda i: b"q" + bytes([i])),
        st.integers(0, 4).map(lambda i: b"h" + bytes([i])),
    )
    return st.lists(op, max_size=24).map(lambda ops: b"\x80\x02" + b"".join(ops) + b".")


_TABLE: list[Any] = []


def _allowed_leaf(x: Any) -> bool:
    if not _TABLE:  # the globals a file may name, which may come back as values themselves
        from torch._weights_only_unpickler import _get_allowed_globals

        _TABLE.extend([*_get_allowed_globals().values(), *stagesave.allowed_globals()])
    plain = (
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        torch.Tensor,
        torch.Size,
        torch.dtype,
        torch.device,
        torch.layout,
        np.ndarray,
        np.generic,
        np.dtype,
        dict,
        list,
        tuple,
        set,
    )
    if isinstance(x, plain) or (isinstance(x, type) and issubclass(x, (np.dtype, np.ndarray))):
        return True  # numpy's classes come back as inert values when a file names them
    return any(x is v for v in _TABLE)


def _fuzz_child(conn: Any, examples: int, workdir: str) -> None:
    """The hypothesis loop, in a forked child; writes each example before loading it."""
    from hypothesis import HealthCheck, given, settings

    from stagesave.safety import safe_torch_load

    stats = {"examples": 0, "loaded": 0, "refused": 0, "slowest": 0.0}
    last = os.path.join(workdir, "last_example.bin")

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(_fuzz_programs())
    def fuzz(pkl: bytes) -> None:
        with open(last, "wb") as f:
            f.write(pkl)
        buf = io.BytesIO()
        w = torch._C.PyTorchFileWriter(buf)
        w.write_record("data.pkl", pkl, len(pkl))
        w.write_end_of_file()
        start = time.monotonic()
        try:
            result = safe_torch_load(io.BytesIO(buf.getvalue()), where="fuzz")
        except CheckpointError:
            stats["refused"] += 1
        else:
            stats["loaded"] += 1
            bad = _violations(result)
            assert not bad, f"loaded {bad} from {pkl!r}"
            items = [result]
            while items:  # every leaf is a plain type or an allow-listed global itself
                x = items.pop()
                if isinstance(x, (dict, OrderedDict, Counter)):
                    items += [*x.keys(), *x.values()]
                elif isinstance(x, (list, tuple, set)):
                    items += list(x)
                else:
                    assert _allowed_leaf(x), f"loaded a {type(x).__name__} from {pkl!r}"
            repr(result)
        finally:
            stats["examples"] += 1
            stats["slowest"] = max(stats["slowest"], time.monotonic() - start)

    try:
        fuzz()
        conn.send(("ok", stats))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", stats, traceback.format_exc()[-4000:]))
    conn.close()
    os._exit(0)


def _run_fuzz(tmp_path: Any, examples: int, timeout: float) -> None:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_fuzz_child, args=(child, examples, os.fspath(tmp_path)))
    p.start()
    child.close()
    got = _receive(parent, timeout)
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    last = tmp_path / "last_example.bin"
    example = last.read_bytes() if last.exists() else b""
    if got is None:
        faultstats.record("fuzz: pickles over the allow-list (no crash/hang/object array)", 1, 1)
        pytest.fail(f"the fuzz child died or hung (exit {p.exitcode}) on {example!r}")
    stats = got[1]
    violations = int(got[0] != "ok")
    faultstats.record(
        "fuzz: pickles over the allow-list (no crash/hang/object array)",
        stats["examples"],
        violations,
    )
    assert got[0] == "ok", got[2]
    assert stats["slowest"] < 10, f"one example took {stats['slowest']:.1f}s"
    print(json.dumps(stats))


def test_fuzz_pickles_over_the_allow_list(tmp_path):
    """A few hundred pickle programs: no crash, no hang, no object array, only family errors."""
    _run_fuzz(tmp_path, examples=400, timeout=540)


@pytest.mark.slow
def test_fuzz_pickles_over_the_allow_list_exhaustive(tmp_path):
    _run_fuzz(tmp_path, examples=20000, timeout=3000)


@pytest.mark.fault_class("hostile pickle: numpy object/pointer routes")
def test_with_torch_forcing_weights_only_loads_work_and_hostile_files_are_refused(
    tmp_path, monkeypatch
):
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 makes torch refuse stagesave's own unpickler: loads then go
    through torch's weights_only unpickler, which still refuses the pointer file."""
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    good = tmp_path / "good.ckpt"
    stagesave.save({"w": torch.arange(6.0), "step": 3}, good)
    loaded = stagesave.load(good)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["step"] == 3
    path = tmp_path / "hostile.ckpt"
    torch_zip(path, program(HOSTILE["dtype_O8_reduce_without_build"]))
    for kind in ENTRIES:
        outcome = run_in_child(kind, path)
        assert outcome[0] == "raised" and "UnsafeCheckpointError" in outcome[1], (kind, outcome)
