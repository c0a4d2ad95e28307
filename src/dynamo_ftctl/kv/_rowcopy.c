/* Row copies for the paged KV block copier (dynamo_ftctl/kv/native.py loads this with ctypes).
 *
 * One call copies n rows of row_bytes bytes: row src_ids[i] of src to row dst_ids[i] of dst,
 * in one pass (torch has no single op for random rows to random rows: it needs a gather into
 * a staging buffer and a scatter out of it). A NULL id array means rows 0..n-1 of that side.
 * Ids are trusted: dynamo_ftctl.kv.copy validated them (range, duplicates, overlap).
 *
 * `threads` splits one call's rows among that many POSIX threads (the caller sets it from
 * torch's thread count, so a copy uses what torch's own copy_ would).
 *
 * With `stream` set, whole 64-byte lines of 16-byte aligned destination rows are written with
 * non-temporal stores (SSE2, every x86-64): a large copy then does not read each destination
 * line into the cache before overwriting it, which is a third of the memory traffic of a
 * cached copy. Other CPUs, and unaligned rows, use memcpy. Plain C99 and pthreads, no Python headers.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define FTCTL_SSE2 1
#endif

/* Bumped whenever the signature of ftctl_copy_rows changes; native.py checks it. */
int ftctl_rowcopy_abi(void) { return 4; }

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

struct rows_job {
    char *dst;
    const char *src;
    int64_t dst_stride, src_stride, row_bytes, begin, end;
    const int64_t *dst_ids, *src_ids;
    int stream;
};

static void *copy_range(void *arg) {
    const struct rows_job *job = arg;
    int streamed = job->stream && ((uintptr_t)job->dst % 16 == 0) && (job->dst_stride % 16 == 0);
    for (int64_t i = job->begin; i < job->end; i++) {
        char *d = job->dst + (job->dst_ids ? job->dst_ids[i] : i) * job->dst_stride;
        const char *s = job->src + (job->src_ids ? job->src_ids[i] : i) * job->src_stride;
        if (streamed)
            copy_streaming(d, s, job->row_bytes);
        else
            memcpy(d, s, (size_t)job->row_bytes);
    }
#ifdef FTCTL_SSE2
    if (streamed) _mm_sfence(); /* this thread's streamed stores land before it is joined */
#endif
    return NULL;
}

#define FTCTL_MAX_THREADS 64

/* `threads` > 1 splits the rows into that many contiguous slices, one per thread (the
 * caller's and threads - 1 started here, joined before returning); a thread that cannot
 * be started leaves its slice to the caller's thread. */
void ftctl_copy_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride,
                     const int64_t *dst_ids, const int64_t *src_ids, int64_t n,
                     int64_t row_bytes, int stream, int threads) {
    struct rows_job jobs[FTCTL_MAX_THREADS];
    pthread_t tids[FTCTL_MAX_THREADS];
    int started[FTCTL_MAX_THREADS] = {0};
    if (threads > FTCTL_MAX_THREADS) threads = FTCTL_MAX_THREADS;
    if (threads < 1 || n < threads) threads = 1;
    for (int t = 0; t < threads; t++) {
        struct rows_job job = {dst, src, dst_stride, src_stride, row_bytes,
                               n * t / threads, n * (t + 1) / threads, dst_ids, src_ids,
                               stream};
        jobs[t] = job;
        if (t > 0) started[t] = pthread_create(&tids[t], NULL, copy_range, &jobs[t]) == 0;
    }
    copy_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            copy_range(&jobs[t]);
    }
}

/* Check n (>= 1) block ids of a cache of num_blocks blocks in one pass (plus one over a
 * byte per block when they are not ascending). Returns the first id (>= 0) when they are
 * one ascending run (ids[i] == ids[0] + i), -3 when ascending, -4 when distinct but
 * unordered, -1 when an id is out of range or repeats (the caller then finds which, to
 * name it), -2 when out of memory. */
int64_t ftctl_check_ids(const int64_t *ids, int64_t n, int64_t num_blocks) {
    int ascending = 1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_blocks) return -1;
        if (i && ids[i] <= ids[i - 1]) ascending = 0;
    }
    if (ascending) return ids[n - 1] - ids[0] == n - 1 ? ids[0] : -3;
    unsigned char *seen = calloc((size_t)num_blocks, 1);
    if (!seen) return -2;
    int64_t status = -4;
    for (int64_t i = 0; i < n && status == -4; i++) {
        if (seen[ids[i]]) status = -1;
        seen[ids[i]] = 1;
    }
    free(seen);
    return status;
}

/* key_out = key ascending, other_out = other in the same order, for n distinct checked ids
 * of a cache of num_blocks blocks (a counting sort). Returns 0, or -2 when out of memory. */
int ftctl_sort_pairs(const int64_t *key, const int64_t *other, int64_t n, int64_t num_blocks,
                     int64_t *key_out, int64_t *other_out) {
    int64_t *slot = malloc((size_t)num_blocks * sizeof(int64_t));
    if (!slot) return -2;
    memset(slot, 0xff, (size_t)num_blocks * sizeof(int64_t)); /* every slot -1 */
    for (int64_t i = 0; i < n; i++) slot[key[i]] = i;
    int64_t j = 0;
    for (int64_t b = 0; b < num_blocks && j < n; b++) {
        if (slot[b] >= 0) {
            key_out[j] = b;
            other_out[j] = other[slot[b]];
            j++;
        }
    }
    free(slot);
    return 0;
}
