/* attnkit native kernels: the interface between the library and attnkit/native/__init__.py,
 * declared once. Every source includes this header, so the compiler checks each exported
 * definition against its prototype here; the Python loader reads this file's text and takes
 * from it the ctypes bindings of the functions, the constants (FLASH_BLOCK, ...), the error
 * table and the fields of the shared structs, and at load compares them with what the
 * library reports about itself (attnkit_abi_constant, attnkit_abi_field, attnkit_error_name,
 * attnkit_error_message): any difference makes the kernels unavailable, with a message that
 * names the function, constant, field or code, expected against found.
 *
 * The format is restricted so that a few regular expressions read it (see _parse_header in
 * __init__.py); keep to it:
 *
 *   - Comments are C block comments only.
 *   - Constants: the X(NAME, VALUE, "what it is") items of AK_CONSTANTS, one an entry, NAME
 *     an identifier AK_*, VALUE a decimal integer literal. C sees them as enum values.
 *   - Error codes: the X(NAME, VALUE, "message") items of AK_ERRORS, values positive and
 *     distinct; 0 (AK_OK) is success and is no entry. Every nonzero return of an exported
 *     kernel is one of them (never a literal).
 *   - Structs shared with Python: #define AK_FIELDS_<name>(F, A) lists the fields of struct
 *     <name> in order, F(type, field) a field, A(type, field, count) an array of count;
 *     AK_STRUCT(<name>); then defines it. Python's ctypes.Structure of it must have the same
 *     fields in the same order, of the same types, at the offsets the library reports.
 *   - Functions: one prototype a declaration, `RET attnkit_NAME(TYPE name, ...);` (may span
 *     lines), or `(void)` for none. RET and every TYPE is one of void (return only), int,
 *     int32_t, int64_t, uint16_t, uint32_t, uint64_t, float, double, or a pointer (any type
 *     followed by *: c_void_p; const char * as a return: a C string). Every exported
 *     attnkit_* symbol is declared here, and every declared one is exported
 *     (tests/test_native_abi.py).
 *
 * Change an interface here, then in the C definition (the compiler holds it to this) and in
 * the Python caller; bump AK_ABI when an exported function or struct changes meaning.
 */
#ifndef ATTNKIT_H
#define ATTNKIT_H

#include <stddef.h>
#include <stdint.h>

/* ---- constants ------------------------------------------------------------------------- */

#define AK_CONSTANTS(X)                                                                      \
    X(AK_ABI, 19, "the interface's version: the loader refuses a library of another")      \
    X(AK_FLASH_BLOCK, 64, "keys per block of the flash kernel")                             \
    X(AK_FLASH_MAX_DIM, 256, "the flash kernel's largest head dim")                         \
    X(AK_MAX_QUERY_ROWS, 16, "the decode kernel's query rows per sequence at most")         \
    X(AK_POOL_MAX, 64, "most workers of one call, the caller included")                     \
    X(AK_POOL_STATS, 9, "int64 counters attnkit_pool_stats writes")                         \
    X(AK_F32, 0, "dtype code: float32")                                                      \
    X(AK_BF16, 1, "dtype code: bfloat16")                                                    \
    X(AK_F16, 2, "dtype code: float16")                                                      \
    X(AK_E4M3, 3, "dtype code: float8 e4m3 (decode pages, fp8 dequantization)")              \
    X(AK_E5M2, 4, "dtype code: float8 e5m2 (decode pages, fp8 dequantization)")

#define AK_CONSTANT_ENUM_(name, value, doc) name = value,
enum { AK_CONSTANTS(AK_CONSTANT_ENUM_) };

/* ---- error codes ----------------------------------------------------------------------- */

#define AK_ERRORS(X)                                                                         \
    X(AK_NONFINITE, 1, "an input holds a NaN or an infinity (the caller runs another path)") \
    X(AK_BAD_ARGS, 2, "the kernel refused its arguments: sizes, strides, indices or dtype "  \
                      "codes it cannot run (nothing was read or written)")                   \
    X(AK_NO_MEMORY, 3, "the kernel could not allocate its scratch buffers")                  \
    X(AK_BAD_HEAD_DIM, 4, "head dims must be multiples of 16 from 16 to AK_FLASH_MAX_DIM")   \
    X(AK_BAD_HEADS, 5, "the query heads must be a multiple of the key/value heads (>= 1)")   \
    X(AK_BAD_DTYPE, 6, "a dtype code is not one of AK_F32, AK_BF16, AK_F16")                 \
    X(AK_BAD_LAYOUT, 7, "float32 value rows overlap (row stride < Dv) without a packed "     \
                        "copy, or paged keys/values lack the packed copy, the lengths or a " \
                        "page size with table_w * page == Lk")                               \
    X(AK_BAD_THREADS, 8, "threads must lie in [1, AK_POOL_MAX]")                             \
    X(AK_NO_BF16_DOT, 9, "bfloat16 dot products need a build with AVX512-BF16, bfloat16 "    \
                         "inputs, head dims that are multiples of 32 and packed values")     \
    X(AK_NO_TABLE, 10, "the relative table's gradient needs the relative table")             \
    X(AK_NO_BUFFER, 11, "a result buffer, the workspace or the non-finite flag is missing")  \
    X(AK_PAGED_BACKWARD, 12, "the backward reads contiguous keys and values, not pages")     \
    X(AK_NOT_BUILT, 13, "this build has no flash kernel (it needs AVX-512, or AVX2 with "    \
                        "FMA and F16C)")

#define AK_ERROR_ENUM_(name, value, message) name = value,
enum ak_status { AK_OK = 0, AK_ERRORS(AK_ERROR_ENUM_) };

/* ---- structs shared with Python -------------------------------------------------------- */

#define AK_FIELD_(type, name) type name;
#define AK_ARRAY_(type, name, count) type name[count];
#define AK_STRUCT(name) typedef struct name { AK_FIELDS_##name(AK_FIELD_, AK_ARRAY_) } name

/* The flash kernel's arguments (flash.c; __init__.py's _FlashArgs). q (N, Hq, Lq, d),
 * k (N, Hkv, Lk, d), v (N, Hkv, Lk, dv), unit stride along the head dim. */
#define AK_FIELDS_ak_flash_args(F, A)                                                        \
    F(const void *, q) F(const void *, k) F(const void *, v)                                \
    F(int32_t, dtype) /* AK_F32, AK_BF16 or AK_F16 */                                        \
    F(int64_t, N) F(int64_t, Hq) F(int64_t, Hkv) F(int64_t, Lq) F(int64_t, Lk)               \
    F(int64_t, d) F(int64_t, dv)                                                             \
    A(int64_t, qs, 3) A(int64_t, ks, 3) A(int64_t, vs, 3) /* strides: batch, head, row */    \
    F(float, scale)                                                                          \
    /* visibility: lo/hi per (N|1, Lq); bstride 0 when shared by the batch */                \
    F(const int32_t *, lo) F(const int32_t *, hi) F(int64_t, bounds_bstride)                 \
    /* segment ids per (N|1, Lq) and (N|1, Lk + AK_FLASH_BLOCK), or NULL */                  \
    F(const int32_t *, qseg) F(const int32_t *, kseg)                                        \
    F(int64_t, qseg_bstride) F(int64_t, kseg_bstride)                                        \
    F(float, softcap) /* 0: none */                                                          \
    F(const float *, alibi) /* slopes (N|1, Hq) times log2(e), or NULL */                    \
    F(int64_t, alibi_bstride)                                                                \
    F(const int32_t *, ipos) /* aligned row positions (N|1, Lq) for ALiBi */                 \
    F(int64_t, ipos_bstride)                                                                 \
    F(const float *, rel) /* (Hq|1, rel_len) times log2(e), or NULL */                       \
    F(int64_t, rel_hstride) F(int64_t, rel_base)                                             \
    F(const float *, sinks) /* (Hq,) or NULL */                                              \
    F(float *, kt) /* scratch: N * Hkv * nkb * d * AK_FLASH_BLOCK floats */                  \
    F(float *, vf) /* scratch: N * Hkv * Lk * dv floats when v is not float32, else NULL */  \
    F(float *, out) F(float *, lse)                                                          \
    F(float *, ws) /* workspace: threads x attnkit_flash_workspace(backward) floats */       \
    F(int32_t, threads)                                                                      \
    /* bfloat16 inputs: q.k and P V by vdpbf16ps (products exact in float32, P rounded to    \
     * bfloat16 as torch's bfloat16 kernels round it); needs AVX512-BF16 and D % 32 == 0 */  \
    F(int32_t, bf16dot)                                                                      \
    F(int32_t, out_dtype) /* out: AK_F32, AK_BF16 or AK_F16 */                               \
    F(int32_t *, bad) /* set to 1 when an input holds a NaN or an infinity */                \
    /* dropout (attnkit/dropout.py's Philox-4x32-10, bit for bit): weight (b, h, i, j) is    \
     * kept when (word >> 8) >= drop_threshold (ak_keep64), kept weights scaled by           \
     * drop_scale */                                                                         \
    F(int32_t, dropout) F(uint32_t, drop_threshold) F(uint32_t, drop_offset)                 \
    F(uint64_t, drop_seed) F(float, drop_scale)                                              \
    /* keys and values read in place from pages through a block table (NULL: k and v as      \
     * above; forward only): k and v are then (P, page, Hkv, d|dv) pages with ks/vs the      \
     * strides of page, head and slot, key j of batch row n is slot j % page of page         \
     * table[n * table_w + j / page], and row n has kv_len[n] keys (Lk is table_w * page;    \
     * keys past kv_len[n] are never read, so the table needs no valid entry for them) */    \
    F(const int64_t *, table) F(int64_t, table_w) F(int64_t, page)                           \
    F(const int64_t *, kv_len)                                                               \
    /* each row's largest score (natural units, after every term; -inf for a row that sees   \
     * no key), (N, Hq, Lq) float32, or NULL */                                              \
    F(float *, mx)                                                                          \
    /* fp8 pages (with table): AK_E4M3 or AK_E5M2, 0 for pages of dtype; the real value of   \
     * k[p, t, h] is k[p, t, h] * kd[p * Hkv + h] (v: vd), kd and vd (P, Hkv) float32; the   \
     * packing pass rounds each dequantized row to dtype (the gathered copy's values) */     \
    F(int32_t, fp8) F(const float *, kd) F(const float *, vd)
AK_STRUCT(ak_flash_args);

/* The flash backward's gradients (flash.c; __init__.py's _FlashGrads). */
#define AK_FIELDS_ak_flash_grads(F, A)                                                       \
    F(const void *, dout) /* (N, Hq, Lq, dv) contiguous, of dout_dtype */                    \
    F(const void *, out)  /* (N, Hq, Lq, dv) contiguous, of out_dtype: the forward's */      \
    F(int32_t, dout_dtype) F(int32_t, out_dtype)                                             \
    F(const float *, lse)  /* (N, Hq, Lq) natural log; -inf rows see nothing */              \
    F(const float *, dlse) /* (N, Hq, Lq) the lse's gradient, or NULL */                     \
    F(float *, delta) /* (N, Hq, Lq), written: rowsum(dO * O) - dlse */                      \
    F(float *, dq) /* threads x (N, Hq, Lq, d), zeroed here; on return dQ is the first */    \
    F(void *, dk) /* (N, Hkv, Lk, d), of grad_dtype */                                       \
    F(void *, dv) /* (N, Hkv, Lk, dv), of grad_dtype */                                      \
    /* the relative table's gradient, expanded as the table (rel), one sum per unit:         \
     * (threads, N, Hkv) x drel_wstride floats, each the unit's G heads' rows of the table   \
     * (its one row for a table shared by the heads), zeroed by the caller; NULL when none   \
     * is needed */                                                                          \
    F(float *, drel) F(int64_t, drel_wstride)                                                \
    /* the gradients' dtype: AK_F32, AK_BF16 or AK_F16 (dK and dV rounded to nearest even    \
     * once from the float32 sums, and dQ into dq_out (N, Hq, Lq, d): no conversion pass of  \
     * the caller's after the call) */                                                       \
    F(int32_t, grad_dtype)                                                                   \
    /* dQ, of grad_dtype (N, Hq, Lq, d); NULL (float32 only): into the first of dq's       \
     * buffers */                                                                            \
    F(void *, dq_out)
AK_STRUCT(ak_flash_grads);

/* ---- functions ------------------------------------------------------------------------- */

/* abi.c: what this library was built with, for the loader's comparison with this header */
int attnkit_native_abi(void); /* AK_ABI */
/* constant i of AK_CONSTANTS: its name, its value in *value; NULL past the last */
const char *attnkit_abi_constant(int i, int64_t *value);
/* entry i of the structs' layouts: "struct" (offset 0, its sizeof) or "struct.field", its
 * offsetof and sizeof; NULL past the last */
const char *attnkit_abi_field(int i, int64_t *offset, int64_t *size);
/* an error code's name and message (AK_ERRORS); NULL for a code that is not in the table */
const char *attnkit_error_name(int code);
const char *attnkit_error_message(int code);

/* decode.c: what the build can do (1 or 0) */
int attnkit_native_has_f16(void);
int attnkit_native_has_dpbf16(void);
int attnkit_native_has_h16(void);
int attnkit_native_has_fp8dot(void);
/* decode.c: attention of a few query rows over a paged cache. math: 1 bfloat16 dot
 * products, 2 float16 arithmetic for e4m3 pages, 4 the value rows inside the key rows (MLA),
 * 8 P V in bfloat16 dot products too (with 1, bfloat16 pages, Dv % 32 == 0). Returns AK_OK, AK_BAD_ARGS (nothing done)
 * or AK_NO_MEMORY. */
int attnkit_decode(const void *q, int q_dtype, int math, float scale, const void *kp,
                   const void *vp, const float *kd, const float *vd,
                   const int64_t *kstrides, const int64_t *vstrides,
                   const int64_t *bt, int64_t bt_cols, const int64_t *seqlens,
                   const int64_t *starts, const int64_t *dims,
                   int64_t splits, int64_t keys_per_split, int dtype,
                   int causal, int bottom_right, int has_left, int64_t left,
                   int has_right, int64_t right,
                   float softcap, const float *alibi, float *out, float *lse,
                   int nthreads);
/* decode.c: fp8 slabs times their descales into float32 or bfloat16. Returns AK_OK or
 * AK_BAD_ARGS (nothing written). */
int attnkit_fp8_dequantize(const void *src, int64_t slabs, int64_t slab_len,
                           const float *descale, int fmt, int out_bf16, void *dst,
                           int nthreads);

/* flash.c: the flash kernel. Both return AK_OK, AK_NONFINITE (an input was not finite: the
 * caller runs another path) or the code of the argument they refuse (nothing computed). */
int attnkit_flash_forward(const ak_flash_args *a);
int attnkit_flash_backward(const ak_flash_args *a, const ak_flash_grads *g);
/* floats of workspace one worker needs (backward: 1, forward: 0) */
int64_t attnkit_flash_workspace(int backward);
int attnkit_flash_has_bf16dot(void);
/* the flash kernel's vector width in bits: 512 (AVX-512), 256 (AVX2 + FMA), 0 (not built) */
int attnkit_flash_available(void);

/* philox.c: Philox-4x32-10 words over a 4-D grid (mode 0: bool keep mask, 1: float32) */
void attnkit_philox(const int64_t *c0, const int64_t *s0, const int64_t *c1, const int64_t *s1,
                    const int64_t *c2, const int64_t *s2, const int64_t *shape, uint32_t offset,
                    uint64_t seed, int mode, uint32_t threshold, void *out);

/* softcap.c: x <- cap * tanh(x); out <- ds * cap * (1 - tanh(raw)^2) */
void attnkit_softcap_forward(float *x, int64_t n, float cap, int threads);
void attnkit_softcap_backward(const float *ds, const float *raw, float *out, int64_t n,
                              float cap, int threads);

/* terms.c: ALiBi's additive tile. Returns AK_OK or AK_BAD_ARGS (nothing written). */
int attnkit_alibi_tile(void *out, int dtype, int64_t N, int64_t H, int64_t R, int64_t C,
                       const int64_t *ip, int64_t ip_n, const int64_t *j, const float *slope,
                       int64_t s_n, int64_t s_r, const uint8_t *vis, int64_t v_n,
                       const int64_t *lo, const int64_t *hi, float *scratch);

/* pool.c: the pool's AK_POOL_STATS counters; its self-check (tests: the calls that broke
 * its contract, or -AK_NO_MEMORY); where the flash kernel's regions run (torch's OpenMP
 * team: 1 when the build has OpenMP) and when a late team sends calls to the pool */
void attnkit_pool_stats(int64_t *out);
int64_t attnkit_pool_check(int64_t calls, int n, int64_t spin);
int attnkit_team_openmp(int on);
void attnkit_team_tune(int64_t late_ns, int64_t hold_ns);

/* peak.c: the most the cores and the memory can do (attnkit/bench/limits.py) */
double attnkit_peak_fma(int64_t iters, int threads, float x, float y, double *cpu_s);
int attnkit_peak_bits(void);
double attnkit_peak_dpbf16(int64_t iters, int threads, uint16_t a, double *cpu_s);
void attnkit_peak_copy(void *dst, const void *src, int64_t bytes, int threads);

#endif
