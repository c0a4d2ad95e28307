/* Row copies for the paged KV block copier (dynamo_ftctl/kv/native.py loads this with ctypes).
 *
 * One call copies n rows of row_bytes bytes: row src_ids[i] of src to row dst_ids[i] of dst,
 * in one pass (torch has no single op for random rows to random rows: it needs a gather into
 * a staging buffer and a scatter out of it). A NULL id array means rows 0..n-1 of that side.
 * Ids are trusted: dynamo_ftctl.kv.copy validated them (range, duplicates, overlap).
 *
 * With `stream` set, whole 64-byte lines of 16-byte aligned destination rows are written with
 * non-temporal stores (SSE2, every x86-64): a large copy then does not read each destination
 * line into the cache before overwriting it, which is a third of the memory traffic of a
 * cached copy. Other CPUs, and unaligned rows, use memcpy. Plain C99, no Python headers.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define FTCTL_SSE2 1
#endif

/* Bumped whenever the signature of ftctl_copy_rows changes; native.py checks it. */
int ftctl_rowcopy_abi(void) { return 1; }

static void copy_streaming(char *dst, const char *src, int64_t bytes) {
#ifdef FTCTL_SSE2
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    if (i < bytes) memcpy(dst + i, src + i, (size_t)(bytes - i));
#else
    memcpy(dst, src, (size_t)bytes);
#endif
}

void ftctl_copy_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride,
                     const int64_t *dst_ids, const int64_t *src_ids, int64_t n,
                     int64_t row_bytes, int stream) {
    int aligned = ((uintptr_t)dst % 16 == 0) && (dst_stride % 16 == 0);
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + (dst_ids ? dst_ids[i] : i) * dst_stride;
        const char *s = src + (src_ids ? src_ids[i] : i) * src_stride;
        if (stream && aligned)
            copy_streaming(d, s, row_bytes);
        else
            memcpy(d, s, (size_t)row_bytes);
    }
#ifdef FTCTL_SSE2
    if (stream && aligned) _mm_sfence(); /* streamed stores are visible before we return */
#endif
}
