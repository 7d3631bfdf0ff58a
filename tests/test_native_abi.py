"""The kernels' interface, declared once in attnkit/native/attnkit.h: the header against the
library's exported symbols and its own tables (constants, struct layouts, error codes), the
loader's checks on altered header text and ctypes structs, and the named error codes the
kernels return."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from attnkit import native

NATIVE_DIR = Path(native.__file__).parent
HEADER = (NATIVE_DIR / "attnkit.h").read_text()
needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernel: {native.unavailable_reason()}")
needs_flash = pytest.mark.skipif(not native._flash_ready(), reason="no flash kernel here")


def _altered(old: str, new: str, text: str = HEADER) -> str:
    """The header's text with ``old`` (which must occur once) replaced by ``new``."""
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _tables():
    return native._library_tables(native._lib())


# ---- the header against the library ------------------------------------------------------


@needs_native
def test_header_declares_exactly_the_exported_symbols() -> None:
    """Every attnkit_* symbol the library exports is declared in attnkit.h, and every
    declared one is exported (nm -D, or ctypes where nm is missing)."""
    declared = set(native._INTERFACE.functions)
    path = native.build_info()["path"]
    nm = shutil.which("nm")
    if nm is not None:
        out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True,
                             text=True, check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines()
                    if line.split() and line.split()[-1].startswith("attnkit_")}
        assert exported - declared == set(), "exported but not declared in attnkit.h"
        assert declared - exported == set(), "declared in attnkit.h but not exported"
    cdll = ctypes.CDLL(path)
    for name in declared:
        assert hasattr(cdll, name), name
    # the removed entry points are gone from the library and from the bindings
    for gone in ("attnkit_flash_block", "attnkit_flash_args_size"):
        assert not hasattr(cdll, gone)
        with pytest.raises(AttributeError):
            getattr(native._lib(), gone)


@needs_native
def test_bindings_come_from_the_prototypes() -> None:
    """Each bound function has the argtypes and restype of its prototype in attnkit.h."""
    lib = native._lib()
    proto = native._INTERFACE.functions["attnkit_decode"]
    assert len(proto.argtypes) == 29 and proto.restype == "int"
    fn = lib.attnkit_decode
    assert fn.restype is ctypes.c_int and len(fn.argtypes) == 29
    assert fn.argtypes[3] is ctypes.c_float and fn.argtypes[11] is ctypes.c_int64
    assert lib.attnkit_peak_fma.restype is ctypes.c_double
    assert lib.attnkit_philox.restype is None
    assert lib.attnkit_error_name.restype is ctypes.c_char_p
    with pytest.raises(ctypes.ArgumentError):  # a str where the header says int
        lib.attnkit_flash_workspace("one")


@needs_native
def test_constants_come_from_the_header_and_match_the_library() -> None:
    consts, layout, errors = _tables()
    assert consts == native._INTERFACE.constants
    assert native.FLASH_BLOCK == consts["AK_FLASH_BLOCK"] == 64
    assert native.MAX_QUERY_ROWS == consts["AK_MAX_QUERY_ROWS"] == 16
    assert native._FLASH_MAX_DIM == consts["AK_FLASH_MAX_DIM"] == 256
    assert native._ABI == consts["AK_ABI"] == native._lib().attnkit_native_abi()
    assert native._DTYPES[torch.bfloat16] == consts["AK_BF16"]
    assert native._FP8[torch.float8_e5m2] == consts["AK_E5M2"]
    assert len(native._POOL_STATS) == consts["AK_POOL_STATS"]
    assert native._check_interface(native._INTERFACE, consts, layout, errors) == []


@needs_native
def test_every_struct_field_is_checked_against_the_library() -> None:
    """The library reports every field of both structs; each lies where ctypes puts it."""
    _, layout, _ = _tables()
    for name, cls in native._STRUCTS.items():
        fields = native._INTERFACE.structs[name]
        assert [f[1] for f in fields] == [f[0] for f in cls._fields_]
        assert layout[name] == (0, ctypes.sizeof(cls))
        for _, field, _ in fields:
            descr = getattr(cls, field)
            assert layout[f"{name}.{field}"] == (descr.offset, descr.size), field
        assert native._check_struct(name, cls, fields, layout) == []


# ---- the checks, on altered inputs -------------------------------------------------------


def test_a_renamed_header_field_is_refused_naming_both() -> None:
    spec = native._parse_header(_altered("F(int64_t, Lk)", "F(int64_t, Lkv)"))
    problems = native._check_struct("ak_flash_args", native._FlashArgs,
                                    spec.structs["ak_flash_args"])
    assert len(problems) == 1
    assert "'Lkv' in attnkit.h but 'Lk' in _FlashArgs" in problems[0]


def test_a_retyped_header_field_is_refused_with_both_types() -> None:
    spec = native._parse_header(_altered("F(int32_t, threads)", "F(int64_t, threads)"))
    problems = native._check_struct("ak_flash_args", native._FlashArgs,
                                    spec.structs["ak_flash_args"])
    assert problems == ["ak_flash_args.threads is int64_t (int64) in attnkit.h but int32 in "
                        "_FlashArgs"]
    spec = native._parse_header(_altered("A(int64_t, qs, 3)", "A(int64_t, qs, 4)"))
    problems = native._check_struct("ak_flash_args", native._FlashArgs,
                                    spec.structs["ak_flash_args"])
    assert "ak_flash_args.qs is int64_t[4] (int64[4])" in problems[0]


def test_an_added_or_dropped_header_field_is_refused() -> None:
    last = "    F(int32_t, fp8) F(const float *, kd) F(const float *, vd)\n"
    spec = native._parse_header(_altered(last, last.rstrip() + " F(int64_t, extra)\n"))
    problems = native._check_struct("ak_flash_args", native._FlashArgs,
                                    spec.structs["ak_flash_args"])
    assert problems == ["attnkit.h's ak_flash_args has field 'extra' (number 54, int64_t), "
                        "which _FlashArgs lacks"]
    spec = native._parse_header(_altered("F(int64_t, drel_wstride)", ""))
    problems = native._check_struct("ak_flash_grads", native._FlashGrads,
                                    spec.structs["ak_flash_grads"])
    assert "'grad_dtype' in attnkit.h but 'drel_wstride' in _FlashGrads" in problems[0]


def test_an_altered_ctypes_struct_is_refused() -> None:
    """A Structure whose fields differ from the header's (swapped, retyped, missing) is
    refused naming the field; one equal to it passes."""
    fields = native._INTERFACE.structs["ak_flash_grads"]
    good = list(native._FlashGrads._fields_)

    def struct(fields_):
        return type("_Grads", (ctypes.Structure,), {"_fields_": fields_})

    assert native._check_struct("ak_flash_grads", struct(good), fields) == []
    swapped = good[:2] + [good[3], good[2]] + good[4:]
    assert "'dout_dtype' in attnkit.h but 'out_dtype' in _Grads" in native._check_struct(
        "ak_flash_grads", struct(swapped), fields)[0]
    retyped = [(n, ctypes.c_int64 if n == "grad_dtype" else t) for n, t in good]
    assert native._check_struct("ak_flash_grads", struct(retyped), fields) == [
        "ak_flash_grads.grad_dtype is int32_t (int32) in attnkit.h but int64 in _Grads"]
    assert "has field 'dq_out' (number 14, void *), which _Grads lacks" in native._check_struct(
        "ak_flash_grads", struct(good[:-1]), fields)[0]


def test_a_layout_the_compiler_gave_otherwise_is_refused() -> None:
    """Offsets and sizes are compared field by field, not only the whole size."""
    cls, fields = native._FlashArgs, native._INTERFACE.structs["ak_flash_args"]
    layout = {"ak_flash_args": (0, ctypes.sizeof(cls))}
    layout.update({f"ak_flash_args.{n}": (getattr(cls, n).offset, getattr(cls, n).size)
                   for n, _ in cls._fields_})
    assert native._check_struct("ak_flash_args", cls, fields, layout) == []
    moved = dict(layout)
    moved["ak_flash_args.scale"] = (cls.scale.offset + 4, 4)  # same total size
    assert native._check_struct("ak_flash_args", cls, fields, moved) == [
        f"ak_flash_args.scale lies at offset {cls.scale.offset + 4}, 4 bytes, in the library "
        f"but at offset {cls.scale.offset}, 4 bytes, in _FlashArgs"]
    missing = {k: v for k, v in layout.items() if k != "ak_flash_args.mx"}
    assert "the library reports no ak_flash_args.mx" in native._check_struct(
        "ak_flash_args", cls, fields, missing)[0]
    bigger = dict(layout, **{"ak_flash_args": (0, ctypes.sizeof(cls) + 8)})
    assert "ak_flash_args has" in native._check_struct("ak_flash_args", cls, fields, bigger)[0]


@needs_native
def test_altered_constants_and_error_table_are_refused_naming_them() -> None:
    consts, layout, errors = _tables()
    spec = native._parse_header(_altered("X(AK_FLASH_BLOCK, 64,", "X(AK_FLASH_BLOCK, 32,"))
    assert native._check_interface(spec, consts, layout, errors) == [
        "constant AK_FLASH_BLOCK: attnkit.h says 32, the library was built with 64"]
    spec = native._parse_header(_altered('X(AK_NO_TABLE, 10, "the relative',
                                         'X(AK_NO_TABLE, 10, "a relative'))
    problems = native._check_interface(spec, consts, layout, errors)
    assert len(problems) == 1 and problems[0].startswith("error code 10: attnkit.h has "
                                                         "AK_NO_TABLE (\"a relative")
    assert "the library AK_NO_TABLE (\"the relative" in problems[0]
    spec = native._parse_header(_altered(
        '    X(AK_E5M2, 4, "dtype code: float8 e5m2 (decode pages, fp8 dequantization)")',
        '    X(AK_E5M2, 4, "dtype code: float8 e5m2 (decode pages, fp8 dequantization)")   \\\n'
        '    X(AK_NEW, 1, "new")'))
    assert native._check_interface(spec, consts, layout, errors) == [
        "constant AK_NEW: attnkit.h says 1, the library has none"]


@needs_native
def test_a_declared_function_the_library_lacks_is_refused() -> None:
    spec = native._parse_header(HEADER.replace(
        "#endif\n", "int attnkit_not_there(int64_t n, const float *x);\n#endif\n"))
    lib = native._lib()
    bound, problems = native._bind(lib.path, lib.cdll, spec)
    assert bound is None and len(problems) == 1
    assert problems[0].startswith("attnkit.h declares attnkit_not_there, which ")


@needs_native
def test_a_mismatch_makes_the_kernels_unavailable_with_the_reason(fresh_native) -> None:
    """At load, any difference makes available() False and unavailable_reason() name it."""
    spec = native._parse_header(_altered("F(float, drop_scale)", "F(double, drop_scale)"))
    fresh_native.setattr(native, "_INTERFACE", spec)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not native.available()
    reason = native.unavailable_reason()
    assert "does not match the interface attnkit.h declares" in reason
    assert "ak_flash_args.drop_scale is double (float64) in attnkit.h but float32 in " \
           "_FlashArgs" in reason
    assert any(issubclass(w.category, native.NativeKernelWarning) for w in seen)
    native._reset()
    abi = native._ABI
    spec = native._parse_header(_altered(f"X(AK_ABI, {abi},", "X(AK_ABI, 99,"))
    fresh_native.setattr(native, "_INTERFACE", spec)
    fresh_native.setattr(native, "_ABI", 99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not native.available()
    assert f"has kernel ABI {abi}, expected 99" in native.unavailable_reason()


def test_header_text_outside_the_format_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"attnkit_x's parameter n has type 'size_t'"):
        native._parse_header(HEADER.replace("#endif\n", "int attnkit_x(size_t n);\n#endif\n"))
    with pytest.raises(ValueError, match=r"attnkit_x's parameter 1 'int' is not 'TYPE name'"):
        native._parse_header(HEADER.replace("#endif\n", "int attnkit_x(int);\n#endif\n"))
    with pytest.raises(ValueError, match=r"cannot read the declaration"):
        native._parse_header(HEADER.replace("#endif\n", "int attnkit_x(int (*f)(int));\n"
                                                        "#endif\n"))
    with pytest.raises(ValueError, match=r"attnkit_decode is declared twice"):
        native._parse_header(HEADER.replace("#endif\n", "int attnkit_decode(void);\n#endif\n"))
    with pytest.raises(ValueError, match=r"codes must be positive and distinct"):
        native._parse_header(_altered("X(AK_NO_MEMORY, 3,", "X(AK_NO_MEMORY, 2,"))
    with pytest.raises(ValueError, match=r"AK_FIELDS_ak_flash_grads holds 'G\(int, x\)'"):
        native._parse_header(_altered("F(int64_t, drel_wstride)", "G(int, x)"))
    with pytest.raises(ValueError, match=r"/\* \*/ comments only"):
        native._parse_header(HEADER + "// a note\n")


# ---- named error codes -------------------------------------------------------------------


def test_each_error_code_gives_its_named_message() -> None:
    codes = native.error_codes()
    assert codes["AK_BAD_ARGS"][0] == 2 and len(codes) >= 13
    kinds = {"AK_NONFINITE": native.FlashNonFinite, "AK_BAD_ARGS": ValueError,
             "AK_NO_MEMORY": MemoryError}
    for name, (code, message) in codes.items():
        exc = native.kernel_error(code, "attnkit_flash_forward", "the caller's context")
        assert type(exc) is kinds.get(name, RuntimeError), name
        assert str(exc) == (f"attnkit_flash_forward: {message} ({name} = {code}); the "
                            f"caller's context")
    exc = native.kernel_error(99, "attnkit_decode")
    assert type(exc) is RuntimeError and "returned 99, which attnkit.h's error table" in str(exc)


@needs_native
def test_the_library_names_each_code_as_the_header_does() -> None:
    lib = native._lib()
    for name, (code, message) in native.error_codes().items():
        assert lib.attnkit_error_name(code).decode() == name
        assert lib.attnkit_error_message(code).decode() == message
    assert lib.attnkit_error_name(0) is None and lib.attnkit_error_message(99) is None


def _flash_call():
    """A valid flash argument block (float32, D = 16) with its tensors and buffers."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    terms = native.FlashTerms(lo=torch.zeros(1, 8, dtype=torch.int32),
                              hi=torch.full((1, 8), 8, dtype=torch.int32))
    a, keep = native._flash_args(q, k, v, 0.25, terms, backward=False)
    keep += native._workspace(a, backward=False)
    kt = torch.empty(a.N * a.Hkv * a.d * native.FLASH_BLOCK)
    out, lse = torch.empty(1, 2, 8, 16), torch.empty(1, 2, 8)
    a.kt, a.out, a.lse = kt.data_ptr(), out.data_ptr(), lse.data_ptr()
    keep += [kt, out, lse, q, k, v]
    return a, keep


@needs_flash
def test_flash_kernel_returns_a_named_code_for_each_refusal() -> None:
    """Each argument the flash kernel refuses gives its own code of the table (and so its
    message through kernel_error); a valid block gives AK_OK."""
    lib, codes = native._lib(), native.error_codes()
    a, keep = _flash_call()
    assert lib.attnkit_flash_forward(ctypes.byref(a)) == 0
    cases = {"AK_BAD_HEAD_DIM": dict(d=8), "AK_BAD_HEADS": dict(Hkv=3),
             "AK_BAD_DTYPE": dict(dtype=7), "AK_BAD_THREADS": dict(threads=0),
             "AK_NO_BUFFER": dict(bad=None), "AK_NO_BF16_DOT": dict(bf16dot=1),
             "AK_BAD_LAYOUT": dict(table=keep[0].data_ptr())}
    for name, change in cases.items():
        b = native._FlashArgs.from_buffer_copy(a)
        for field, value in change.items():
            setattr(b, field, value)
        rc = lib.attnkit_flash_forward(ctypes.byref(b))
        assert rc == codes[name][0], (name, rc)
        with pytest.raises(RuntimeError, match=re.escape(f"({name} = {rc})")):
            raise native.kernel_error(rc, "attnkit_flash_forward")
    g = native._FlashGrads()
    b = native._FlashArgs.from_buffer_copy(a)
    b.table = keep[0].data_ptr()
    assert lib.attnkit_flash_backward(ctypes.byref(b), ctypes.byref(g)) == \
        codes["AK_PAGED_BACKWARD"][0]
    g.drel = keep[0].data_ptr()
    assert lib.attnkit_flash_backward(ctypes.byref(a), ctypes.byref(g)) == \
        codes["AK_NO_TABLE"][0]
    g.drel, g.dout_dtype = None, 5
    assert lib.attnkit_flash_backward(ctypes.byref(a), ctypes.byref(g)) == \
        codes["AK_BAD_DTYPE"][0]
    g.dout_dtype = 0
    assert lib.attnkit_flash_backward(ctypes.byref(a), ctypes.byref(g)) == \
        codes["AK_NO_BUFFER"][0]
    del keep


@needs_flash
def test_a_non_finite_input_is_the_named_nonfinite_code() -> None:
    q = torch.randn(1, 2, 8, 16)
    q[0, 1, 3, 5] = float("nan")
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    terms = native.FlashTerms(lo=torch.zeros(1, 8, dtype=torch.int32),
                              hi=torch.full((1, 8), 8, dtype=torch.int32))
    with pytest.raises(native.FlashNonFinite, match=r"attnkit_flash_forward: an input holds a "
                                                    r"NaN or an infinity .*\(AK_NONFINITE = 1\)"):
        native.flash_forward(q, k, v, 0.25, terms)


@needs_native
def test_decode_and_term_kernels_refuse_with_named_codes() -> None:
    """attnkit_decode's refusal reaches the caller as AK_BAD_ARGS (ValueError, with the
    decode kernel's context); attnkit_alibi_tile and attnkit_fp8_dequantize refuse with it;
    the pool's self-check counts, and returns no code."""
    lib, bad = native._lib(), native.error_codes()["AK_BAD_ARGS"][0]
    q = torch.randn(1, 2, 1, 16)
    kp, vp = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16)
    with pytest.raises(ValueError, match=r"refused its arguments.*\(AK_BAD_ARGS = 2\); the "
                                         r"native decode kernel checks for a page index"):
        native.paged_decode(q, kp, vp, torch.tensor([[0, 5]]), torch.tensor([8]),
                            scale=0.25, causal=False)
    one = torch.zeros(4, dtype=torch.int64)
    scratch = torch.empty(8)
    assert lib.attnkit_alibi_tile(scratch.data_ptr(), 0, 0, 1, 1, 1, one.data_ptr(), 1,
                                  one.data_ptr(), scratch.data_ptr(), 1, 1, None, 1, None,
                                  None, scratch.data_ptr()) == bad  # N = 0
    assert lib.attnkit_fp8_dequantize(None, 1, 1, None, 3, 0, None, 1) == bad
    assert lib.attnkit_pool_check(3, 2, 10) == 0


# ---- the sources -------------------------------------------------------------------------


def test_every_source_includes_the_header_and_returns_no_literal_codes() -> None:
    """A supplement to the behaviour above: every C source includes attnkit.h, no source
    returns a negative literal, and the kernels that return codes return only names."""
    returning = ("attnkit_decode", "attnkit_fp8_dequantize", "attnkit_flash_forward",
                 "attnkit_flash_backward", "attnkit_alibi_tile")
    names = set(native.error_codes()) | {"AK_OK"}
    for src in native._SOURCES:
        text = re.sub(r"/\*.*?\*/", " ", src.read_text(), flags=re.S)
        assert '#include "attnkit.h"' in text, src.name
        assert not re.search(r"\breturn\s*-\s*\d", text), src.name
        for fn in returning:
            for m in re.finditer(rf"^int {fn}\([^)]*\)\s*{{", text, re.M):
                depth, i = 1, m.end()
                while depth:
                    depth += {"{": 1, "}": -1}.get(text[i], 0)
                    i += 1
                for ret in re.findall(r"\breturn\b([^;]*);", text[m.end():i]):
                    assert not re.search(r"\b\d+\b", ret), (src.name, fn, ret)
                    assert set(re.findall(r"\bAK_\w+", ret)) <= names, (src.name, fn, ret)
                    assert re.findall(r"\bAK_\w+", ret), (src.name, fn, ret)
