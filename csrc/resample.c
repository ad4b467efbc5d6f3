/*
 * torchvision's uint8 bilinear resize, pixel for pixel, without torch and without the GIL.
 *
 * The algorithm is libtorch's (aten/src/ATen/native/cpu/UpSampleKernel.cpp computes the weights,
 * UpSampleKernelAVXAntialias.h applies them), which follows Pillow's resample:
 *   - per output index i of an axis of `in` -> `out` pixels, scale = in / out (double):
 *     antialias: the triangle filter widened to `support` = max(scale, 1) source pixels each side of
 *       centre = scale * (i + 0.5); taps xmin .. xmin + xsize (clamped to the image), each weight
 *       filter((xmin + j - centre + 0.5) / max(scale, 1)), normalised by their sum;
 *     no antialias: the two taps around scale * (i + 0.5) - 0.5 (clamped at 0), weights 1 - l and l,
 *       taps outside the image folded onto the edge pixel;
 *   - the weights are quantised to int16 at the largest precision p < 22 bits whose largest weight
 *     still fits (round half away from zero);
 *   - horizontal pass first, into uint8, then the vertical pass on that: each output byte is
 *     clamp((sum of weight * pixel + 2^(p-1)) >> p, 0, 255), summed exactly in 32-bit integers
 *     (so the order of the sum, and SIMD or not, cannot change a pixel);
 *   - an axis whose size does not change is not resampled.
 * tests/test_resample_native.py checks every pixel against torch on thousands of size pairs.
 */
#include "resample.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int ksize;    /* taps stored per output index */
    int prec;     /* weights are integers scaled by 2^prec */
    int *xmin;    /* first source index per output index */
    int *xsize;   /* taps used per output index */
    int16_t *w;   /* out * ksize weights */
    int32_t *pairs; /* out * (ksize + 1) / 2: weights 2j and 2j + 1 (0 past xsize) as one 32-bit word */
} axis_t;

static void axis_free(axis_t *a) {
    free(a->xmin);
    free(a->xsize);
    free(a->w);
    free(a->pairs);
}

static double triangle(double x) {
    if (x < 0.0)
        x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Float weights of output index i, antialiased; returns their largest value. */
static double weights_aa(int64_t i, int64_t in, double scale, double support, double *wt, int64_t kmax,
                         int64_t *xmin, int64_t *xsize) {
    double center = scale * ((double)i + 0.5);
    double total = 0.0, invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    int64_t lo = (int64_t)(center - support + 0.5), hi = (int64_t)(center + support + 0.5);
    *xmin = lo > 0 ? lo : 0;
    int64_t n = (hi < in ? hi : in) - *xmin;
    n = n < 0 ? 0 : (n > kmax ? kmax : n); /* rounding can make one tap too many: dropped */
    *xsize = n;
    int64_t j;
    for (j = 0; j < n; j++) {
        double w = triangle(((double)(j + *xmin) - center + 0.5) * invscale);
        wt[j] = w;
        total += w;
    }
    double wmax = 0.0;
    if (total != 0.0) {
        for (j = 0; j < n; j++) {
            wt[j] /= total;
            wmax = wt[j] > wmax ? wt[j] : wmax;
        }
    }
    for (; j < kmax; j++)
        wt[j] = 0.0;
    return wmax;
}

/* Float weights of output index i without antialiasing (two taps, folded at the edges). */
static double weights_plain(int64_t i, int64_t in, double scale, double *wt, int64_t kmax, int64_t *xmin,
                            int64_t *xsize) {
    double real = scale * ((double)i + 0.5) - 0.5;
    if (real < 0.0)
        real = 0.0;
    int64_t index = (int64_t)floorf((float)real); /* libtorch rounds through float here */
    if (index > in - 1)
        index = in - 1;
    double lambda = real - (double)index;
    lambda = lambda < 0.0 ? 0.0 : (lambda > 1.0 ? 1.0 : lambda);
    int64_t support = (int64_t)((double)kmax * 0.5);
    int64_t umin = index - support + 1, umax = index + support + 1;
    *xmin = umin > 0 ? umin : 0;
    int64_t n = (umax < in ? umax : in) - *xmin;
    n = n < 0 ? 0 : (n > kmax ? kmax : n);
    *xsize = n;
    int64_t at = 0;
    double wmax = 0.0;
    for (int64_t j = 0; j < kmax; j++) {
        wt[j] = 0.0;
        double w = triangle((double)(j + 1 - support) - lambda);
        if (umin + j <= 0)
            at = 0;
        else if (umin + j >= in - 1)
            at = n - 1;
        wt[at] += w;
        wmax = wt[at] > wmax ? wt[at] : wmax;
        at++;
    }
    return wmax;
}

static int axis_make(int in, int out, int antialias, axis_t *a) {
    memset(a, 0, sizeof(*a));
    double scale = (double)in / (double)out;
    double support = antialias ? (scale >= 1.0 ? 1.0 * scale : 1.0) : 1.0;
    int kmax = antialias ? (int)ceil(support) * 2 + 1 : 2;
    double *wt = (double *)malloc(sizeof(double) * (size_t)out * (size_t)kmax);
    a->xmin = (int *)malloc(sizeof(int) * (size_t)out);
    a->xsize = (int *)malloc(sizeof(int) * (size_t)out);
    a->w = (int16_t *)malloc(sizeof(int16_t) * (size_t)out * (size_t)kmax);
    if (wt == NULL || a->xmin == NULL || a->xsize == NULL || a->w == NULL) {
        free(wt);
        axis_free(a);
        return -1;
    }
    double wmax = 0.0;
    for (int i = 0; i < out; i++) {
        int64_t xmin, xsize;
        double m = antialias ? weights_aa(i, in, scale, support, wt + (size_t)i * kmax, kmax, &xmin, &xsize)
                             : weights_plain(i, in, scale, wt + (size_t)i * kmax, kmax, &xmin, &xsize);
        wmax = m > wmax ? m : wmax;
        a->xmin[i] = (int)xmin;
        a->xsize[i] = (int)xsize;
    }
    int prec;
    for (prec = 0; prec < 22; prec++) {
        int next = (int)(0.5 + wmax * (double)(1 << (prec + 1)));
        if (next >= (1 << 15))
            break;
    }
    for (size_t k = 0; k < (size_t)out * kmax; k++) {
        double v = wt[k] * (double)(1 << prec);
        a->w[k] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
    free(wt);
    a->ksize = kmax;
    a->prec = prec;
    int kp = (kmax + 1) / 2;
    a->pairs = (int32_t *)malloc(sizeof(int32_t) * (size_t)out * kp);
    if (a->pairs == NULL) {
        axis_free(a);
        return -1;
    }
    for (int i = 0; i < out; i++) {
        const int16_t *w = a->w + (size_t)i * kmax;
        for (int j = 0; j < kp; j++) {
            uint32_t lo = 2 * j < a->xsize[i] ? (uint16_t)w[2 * j] : 0;
            uint32_t hi = 2 * j + 1 < a->xsize[i] ? (uint16_t)w[2 * j + 1] : 0;
            a->pairs[(size_t)i * kp + j] = (int32_t)(lo | (hi << 16));
        }
    }
    return 0;
}

static inline unsigned char settle(int32_t acc, int prec) {
    acc >>= prec; /* arithmetic shift, as _mm_srai_epi32 */
    return (unsigned char)(acc < 0 ? 0 : (acc > 255 ? 255 : acc));
}

/* Output row y's bytes i..bytes of a vertical pass, one at a time (the SIMD passes' last bytes). */
static void vertical_tail(const unsigned char *rows, ptrdiff_t sstride, const axis_t *a, int y, int i, int bytes,
                          unsigned char *d) {
    const int16_t *w = a->w + (size_t)y * a->ksize;
    for (; i < bytes; i++) {
        int32_t acc = (int32_t)1 << (a->prec - 1);
        for (int k = 0; k < a->xsize[y]; k++)
            acc += (int32_t)w[k] * rows[(ptrdiff_t)k * sstride + i];
        d[i] = settle(acc, a->prec);
    }
}

/* Rows y0..y1 of src, resampled along x into rows 0.. of dst (output columns x0..dw). */
static void pass_horizontal(const unsigned char *src, ptrdiff_t sstride, int y0, int y1, const axis_t *a, int x0,
                            int dw, unsigned char *dst, ptrdiff_t dstride) {
    const int32_t half = (int32_t)1 << (a->prec - 1);
    for (int y = y0; y < y1; y++) {
        const unsigned char *s = src + (ptrdiff_t)y * sstride;
        unsigned char *d = dst + (ptrdiff_t)(y - y0) * dstride;
        for (int x = x0; x < dw; x++) {
            const int16_t *w = a->w + (size_t)x * a->ksize;
            const unsigned char *p = s + (size_t)a->xmin[x] * 3;
            int32_t r = half, g = half, b = half;
            for (int k = 0; k < a->xsize[x]; k++) {
                r += (int32_t)w[k] * p[3 * k];
                g += (int32_t)w[k] * p[3 * k + 1];
                b += (int32_t)w[k] * p[3 * k + 2];
            }
            d[3 * x] = settle(r, a->prec);
            d[3 * x + 1] = settle(g, a->prec);
            d[3 * x + 2] = settle(b, a->prec);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_SSSE3_PATH 1

/* pass_horizontal with SSSE3: two taps per multiply-add, four rows at a time (they share the
 * weights). Bytes R0 G0 B0 R1 G1 B1 of two adjacent pixels become 16-bit lanes (R0 R1 G0 G1 B0 B1 0 0);
 * _mm_madd_epi16 with (w0 w1 w0 w1 ...) gives the pair's three 32-bit sums at once. Exact integers,
 * so the pixels are pass_horizontal's. */
__attribute__((target("ssse3"))) static inline __m128i taps_ssse3(const unsigned char *p, const int32_t *pairs,
                                                                   int npairs, __m128i acc) {
    const __m128i pair01 = _mm_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    for (int j = 0; j < npairs; j++) {
        __m128i v = _mm_loadl_epi64((const __m128i *)(p + 6 * j));
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_shuffle_epi8(v, pair01), _mm_set1_epi32(pairs[j])));
    }
    return acc;
}

__attribute__((target("ssse3"))) static inline void store_ssse3(__m128i acc, int prec, unsigned char *d) {
    acc = _mm_srai_epi32(acc, prec);
    acc = _mm_packus_epi16(_mm_packs_epi32(acc, acc), acc);
    uint32_t rgb = (uint32_t)_mm_cvtsi128_si32(acc);
    d[0] = (unsigned char)rgb;
    d[1] = (unsigned char)(rgb >> 8);
    d[2] = (unsigned char)(rgb >> 16);
}

__attribute__((target("ssse3"))) static void pass_horizontal_ssse3(const unsigned char *src, ptrdiff_t sstride,
                                                                    int y0, int y1, const axis_t *a, int simd_end,
                                                                    unsigned char *dst, ptrdiff_t dstride) {
    const __m128i half = _mm_set1_epi32((int32_t)1 << (a->prec - 1));
    const int kp = (a->ksize + 1) / 2;
    for (int y = y0; y < y1; y += 4) {
        int rows = y1 - y < 4 ? y1 - y : 4;
        const unsigned char *s[4];
        unsigned char *d[4];
        for (int r = 0; r < 4; r++) { /* a short last group repeats its first row */
            s[r] = src + (ptrdiff_t)(y + (r < rows ? r : 0)) * sstride;
            d[r] = dst + (ptrdiff_t)(y - y0 + r) * dstride;
        }
        for (int x = 0; x < simd_end; x++) {
            const int32_t *pairs = a->pairs + (size_t)x * kp;
            const int np = (a->xsize[x] + 1) / 2;
            const size_t off = (size_t)a->xmin[x] * 3;
            __m128i a0 = taps_ssse3(s[0] + off, pairs, np, half);
            __m128i a1 = taps_ssse3(s[1] + off, pairs, np, half);
            __m128i a2 = taps_ssse3(s[2] + off, pairs, np, half);
            __m128i a3 = taps_ssse3(s[3] + off, pairs, np, half);
            store_ssse3(a0, a->prec, d[0] + 3 * x);
            if (rows > 1)
                store_ssse3(a1, a->prec, d[1] + 3 * x);
            if (rows > 2)
                store_ssse3(a2, a->prec, d[2] + 3 * x);
            if (rows > 3)
                store_ssse3(a3, a->prec, d[3] + 3 * x);
        }
    }
}
/* pass_horizontal_ssse3 with AVX2: two rows per 256-bit register (one per 128-bit lane). */
__attribute__((target("avx2"))) static inline __m256i taps_avx2(const unsigned char *p0, const unsigned char *p1,
                                                                const int32_t *pairs, int npairs, __m256i acc) {
    const __m256i pair01 = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                            0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i pair23 = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1,
                                            6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
    int j = 0;
    for (; j + 2 <= npairs; j += 2) { /* four taps from one 16-byte load per row */
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 6 * j))),
                                            _mm_loadu_si128((const __m128i *)(p1 + 6 * j)), 1);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(v, pair01), _mm256_set1_epi32(pairs[j])));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(v, pair23),
                                                      _mm256_set1_epi32(pairs[j + 1])));
    }
    if (j < npairs) {
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(p0 + 6 * j))),
                                            _mm_loadl_epi64((const __m128i *)(p1 + 6 * j)), 1);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(v, pair01), _mm256_set1_epi32(pairs[j])));
    }
    return acc;
}

__attribute__((target("avx2"))) static void pass_horizontal_avx2(const unsigned char *src, ptrdiff_t sstride,
                                                                  int y0, int y1, const axis_t *a, int simd_end,
                                                                  int dw, unsigned char *dst, ptrdiff_t dstride) {
    const __m256i half = _mm256_set1_epi32((int32_t)1 << (a->prec - 1));
    const int kp = (a->ksize + 1) / 2;
    for (int y = y0; y < y1; y += 4) {
        int rows = y1 - y < 4 ? y1 - y : 4;
        const unsigned char *s[4];
        unsigned char *d[4];
        for (int r = 0; r < 4; r++) { /* a short last group repeats its first row */
            s[r] = src + (ptrdiff_t)(y + (r < rows ? r : 0)) * sstride;
            d[r] = dst + (ptrdiff_t)(y - y0 + r) * dstride;
        }
        for (int x = 0; x < simd_end; x++) {
            const int32_t *pairs = a->pairs + (size_t)x * kp;
            const int np = (a->xsize[x] + 1) / 2;
            const size_t off = (size_t)a->xmin[x] * 3;
            __m256i a01 = taps_avx2(s[0] + off, s[1] + off, pairs, np, half);
            __m256i a23 = taps_avx2(s[2] + off, s[3] + off, pairs, np, half);
            a01 = _mm256_srai_epi32(a01, a->prec);
            a23 = _mm256_srai_epi32(a23, a->prec);
            __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(a01, a23), a01);
            /* per 128-bit lane, bytes 0..3: row 0 (lane 0) or 1 (lane 1); bytes 4..7: row 2 or 3 */
            uint64_t lo = (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(packed));
            uint64_t hi = (uint64_t)_mm_cvtsi128_si64(_mm256_extracti128_si256(packed, 1));
            uint32_t px[4] = {(uint32_t)lo, (uint32_t)hi, (uint32_t)(lo >> 32), (uint32_t)(hi >> 32)};
            if (x + 1 < dw) { /* 4 bytes: the 4th lands on the next pixel, which is written next */
                for (int r = 0; r < rows; r++)
                    memcpy(d[r] + 3 * x, &px[r], 4);
            } else {
                for (int r = 0; r < rows; r++)
                    memcpy(d[r] + 3 * x, &px[r], 3);
            }
        }
    }
}

/* pass_vertical_sse2 with AVX2: 32 bytes at a time (unpack and pack work per 128-bit lane, so the
 * bytes come back in order). */
__attribute__((target("avx2"))) static void pass_vertical_avx2(const unsigned char *src, ptrdiff_t sstride, int first,
                                                                const axis_t *a, int dh, int bytes,
                                                                unsigned char *dst, ptrdiff_t dstride) {
    const __m256i half = _mm256_set1_epi32((int32_t)1 << (a->prec - 1)), zero = _mm256_setzero_si256();
    const int kp = (a->ksize + 1) / 2;
    for (int y = 0; y < dh; y++) {
        const int32_t *pairs = a->pairs + (size_t)y * kp;
        const int n = a->xsize[y];
        const unsigned char *rows = src + (ptrdiff_t)(a->xmin[y] - first) * sstride;
        unsigned char *d = dst + (ptrdiff_t)y * dstride;
        int i = 0;
        for (; i + 32 <= bytes; i += 32) {
            __m256i s0 = half, s1 = half, s2 = half, s3 = half;
            for (int k = 0; k < n; k += 2) {
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(rows + (ptrdiff_t)k * sstride + i));
                __m256i r1 = k + 1 < n ? _mm256_loadu_si256((const __m256i *)(rows + (ptrdiff_t)(k + 1) * sstride + i))
                                       : zero;
                __m256i w = _mm256_set1_epi32(pairs[k / 2]);
                __m256i lo = _mm256_unpacklo_epi8(r0, r1), hi = _mm256_unpackhi_epi8(r0, r1);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w));
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), w));
                s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), w));
            }
            __m256i p01 = _mm256_packs_epi32(_mm256_srai_epi32(s0, a->prec), _mm256_srai_epi32(s1, a->prec));
            __m256i p23 = _mm256_packs_epi32(_mm256_srai_epi32(s2, a->prec), _mm256_srai_epi32(s3, a->prec));
            _mm256_storeu_si256((__m256i *)(d + i), _mm256_packus_epi16(p01, p23));
        }
        vertical_tail(rows, sstride, a, y, i, bytes, d);
    }
}

/* pass_vertical with SSE2 (every x86-64 CPU has it): 16 bytes of two source rows at a time, their
 * bytes interleaved into 16-bit lanes so _mm_madd_epi16 sums both taps in one 32-bit lane. */
static void pass_vertical_sse2(const unsigned char *src, ptrdiff_t sstride, int first, const axis_t *a, int dh,
                               int bytes, unsigned char *dst, ptrdiff_t dstride) {
    const __m128i half = _mm_set1_epi32((int32_t)1 << (a->prec - 1)), zero = _mm_setzero_si128();
    const int kp = (a->ksize + 1) / 2;
    for (int y = 0; y < dh; y++) {
        const int32_t *pairs = a->pairs + (size_t)y * kp;
        const int n = a->xsize[y];
        const unsigned char *rows = src + (ptrdiff_t)(a->xmin[y] - first) * sstride;
        unsigned char *d = dst + (ptrdiff_t)y * dstride;
        int i = 0;
        for (; i + 16 <= bytes; i += 16) {
            __m128i s0 = half, s1 = half, s2 = half, s3 = half;
            for (int k = 0; k < n; k += 2) {
                __m128i r0 = _mm_loadu_si128((const __m128i *)(rows + (ptrdiff_t)k * sstride + i));
                __m128i r1 = k + 1 < n ? _mm_loadu_si128((const __m128i *)(rows + (ptrdiff_t)(k + 1) * sstride + i))
                                       : zero;
                __m128i w = _mm_set1_epi32(pairs[k / 2]);
                __m128i lo = _mm_unpacklo_epi8(r0, r1), hi = _mm_unpackhi_epi8(r0, r1);
                s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w));
                s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w));
                s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w));
                s3 = _mm_add_epi32(s3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w));
            }
            __m128i p01 = _mm_packs_epi32(_mm_srai_epi32(s0, a->prec), _mm_srai_epi32(s1, a->prec));
            __m128i p23 = _mm_packs_epi32(_mm_srai_epi32(s2, a->prec), _mm_srai_epi32(s3, a->prec));
            _mm_storeu_si128((__m128i *)(d + i), _mm_packus_epi16(p01, p23));
        }
        vertical_tail(rows, sstride, a, y, i, bytes, d);
    }
}
#endif

/* Rows y0..y1 of src along x, with SIMD where the CPU has it. */
static void resample_rows(const unsigned char *src, ptrdiff_t sstride, int y0, int y1, const axis_t *a, int sw, int dw,
                          unsigned char *dst, ptrdiff_t dstride, int simd) {
    int x0 = 0;
#ifdef HAVE_SSSE3_PATH
    if (simd && __builtin_cpu_supports("ssse3")) {
        /* output pixels whose loads (16 bytes at most 7 past their last tap) stay inside the source
         * row take the SIMD loops */
        while (x0 < dw && 3 * (a->xmin[x0] + a->xsize[x0]) + 7 <= 3 * sw)
            x0++;
        if (simd >= 2 && __builtin_cpu_supports("avx2"))
            pass_horizontal_avx2(src, sstride, y0, y1, a, x0, dw, dst, dstride);
        else
            pass_horizontal_ssse3(src, sstride, y0, y1, a, x0, dst, dstride);
    }
#endif
    if (x0 < dw) /* the last pixels of each row (taps near its end), or all of them */
        pass_horizontal(src, sstride, y0, y1, a, x0, dw, dst, dstride);
}

/* All of dst's dh rows, each a weighted sum of rows of src (row 0 of src is source row `first`). */
static void pass_vertical(const unsigned char *src, ptrdiff_t sstride, int first, const axis_t *a, int dh,
                          int bytes, unsigned char *dst, ptrdiff_t dstride, int32_t *acc) {
    const int32_t half = (int32_t)1 << (a->prec - 1);
    for (int y = 0; y < dh; y++) {
        const int16_t *w = a->w + (size_t)y * a->ksize;
        for (int i = 0; i < bytes; i++)
            acc[i] = half;
        for (int k = 0; k < a->xsize[y]; k++) {
            const unsigned char *s = src + (ptrdiff_t)(a->xmin[y] - first + k) * sstride;
            const int32_t wk = w[k];
            for (int i = 0; i < bytes; i++)
                acc[i] += wk * s[i];
        }
        unsigned char *d = dst + (ptrdiff_t)y * dstride;
        for (int i = 0; i < bytes; i++)
            d[i] = settle(acc[i], a->prec);
    }
}

/* All of dst's rows from rows of src (along y), with SIMD where the CPU has it. */
static void columns(const unsigned char *src, ptrdiff_t sstride, int first, const axis_t *a, int dh, int bytes,
                    unsigned char *dst, ptrdiff_t dstride, int32_t *acc, int simd) {
#ifdef HAVE_SSSE3_PATH
    if (simd) {
        if (simd >= 2 && __builtin_cpu_supports("avx2"))
            pass_vertical_avx2(src, sstride, first, a, dh, bytes, dst, dstride);
        else
            pass_vertical_sse2(src, sstride, first, a, dh, bytes, dst, dstride);
        return;
    }
#endif
    pass_vertical(src, sstride, first, a, dh, bytes, dst, dstride, acc);
}

int stoker_resample(const unsigned char *src, int sh, int sw, ptrdiff_t src_stride, unsigned char *dst,
                    int dh, int dw, ptrdiff_t dst_stride, int antialias, int simd) {
    int horizontal = sw != dw, vertical = sh != dh;
    if (!horizontal && !vertical) {
        for (int y = 0; y < dh; y++)
            memcpy(dst + (ptrdiff_t)y * dst_stride, src + (ptrdiff_t)y * src_stride, (size_t)dw * 3);
        return 0;
    }
    axis_t ax, ay;
    memset(&ax, 0, sizeof(ax));
    memset(&ay, 0, sizeof(ay));
    unsigned char *mid = NULL;
    int32_t *acc = NULL;
    int status = -1;
    if (horizontal && axis_make(sw, dw, antialias, &ax) < 0)
        goto done;
    if (vertical && axis_make(sh, dh, antialias, &ay) < 0)
        goto done;
    if (!vertical) {
        resample_rows(src, src_stride, 0, sh, &ax, sw, dw, dst, dst_stride, simd);
        status = 0;
        goto done;
    }
    acc = (int32_t *)malloc(sizeof(int32_t) * (size_t)dw * 3);
    if (acc == NULL)
        goto done;
    if (!horizontal) {
        columns(src, src_stride, 0, &ay, dh, dw * 3, dst, dst_stride, acc, simd);
        status = 0;
        goto done;
    }
    /* only the source rows the vertical pass reads go through the horizontal one */
    int lo = ay.xmin[0], hi = 0;
    for (int y = 0; y < dh; y++) {
        lo = ay.xmin[y] < lo ? ay.xmin[y] : lo;
        hi = ay.xmin[y] + ay.xsize[y] > hi ? ay.xmin[y] + ay.xsize[y] : hi;
    }
    if (hi <= lo)
        hi = lo + 1;
    mid = (unsigned char *)malloc((size_t)(hi - lo) * dw * 3);
    if (mid == NULL)
        goto done;
    resample_rows(src, src_stride, lo, hi, &ax, sw, dw, mid, (ptrdiff_t)dw * 3, simd);
    columns(mid, (ptrdiff_t)dw * 3, lo, &ay, dh, dw * 3, dst, dst_stride, acc, simd);
    status = 0;
done:
    free(mid);
    free(acc);
    axis_free(&ax);
    axis_free(&ay);
    return status;
}

int stoker_place(const unsigned char *region, int h, int w, ptrdiff_t stride, const int pad[4], int rh, int rw,
                 int py, int px, unsigned char *dst, int oh, int ow, ptrdiff_t dst_stride, int flip, int antialias) {
    const unsigned char *src = region;
    unsigned char *padded = NULL, *whole = NULL;
    int sh = h, sw = w, status = 0;
    ptrdiff_t sstride = stride;
    if (pad[0] || pad[1] || pad[2] || pad[3]) { /* zeros around the pixels, as a copyMakeBorder */
        sh = h + pad[0] + pad[1];
        sw = w + pad[2] + pad[3];
        sstride = (ptrdiff_t)sw * 3;
        padded = (unsigned char *)calloc((size_t)sh * sw * 3, 1);
        if (padded == NULL)
            return -1;
        for (int y = 0; y < h; y++)
            memcpy(padded + (ptrdiff_t)(y + pad[0]) * sstride + (ptrdiff_t)pad[2] * 3, region + (ptrdiff_t)y * stride,
                   (size_t)w * 3);
        src = padded;
    }
    if (py == 0 && px == 0 && rh == oh && rw == ow) {
        status = stoker_resample(src, sh, sw, sstride, dst, oh, ow, dst_stride, antialias, 2);
    } else {
        int y0 = py > 0 ? py : 0, y1 = py + rh < oh ? py + rh : oh;
        int x0 = px > 0 ? px : 0, x1 = px + rw < ow ? px + rw : ow;
        if (!(y0 == 0 && x0 == 0 && y1 == oh && x1 == ow))
            for (int y = 0; y < oh; y++)
                memset(dst + (ptrdiff_t)y * dst_stride, 0, (size_t)ow * 3);
        if (y1 > y0 && x1 > x0) {
            if (y0 == py && x0 == px && y1 - y0 == rh && x1 - x0 == rw) {
                status = stoker_resample(src, sh, sw, sstride, dst + (ptrdiff_t)y0 * dst_stride + (ptrdiff_t)x0 * 3,
                                         rh, rw, dst_stride, antialias, 2);
            } else { /* only part of the resampled pixels is the output */
                whole = (unsigned char *)malloc((size_t)rh * rw * 3);
                status = whole == NULL ? -1 : stoker_resample(src, sh, sw, sstride, whole, rh, rw, (ptrdiff_t)rw * 3,
                                                              antialias, 2);
                for (int y = y0; status == 0 && y < y1; y++)
                    memcpy(dst + (ptrdiff_t)y * dst_stride + (ptrdiff_t)x0 * 3,
                           whole + ((ptrdiff_t)(y - py) * rw + (x0 - px)) * 3, (size_t)(x1 - x0) * 3);
            }
        }
    }
    if (status == 0 && flip) {
        for (int y = 0; y < oh; y++) {
            unsigned char *l = dst + (ptrdiff_t)y * dst_stride, *r = l + (ptrdiff_t)(ow - 1) * 3;
            for (; l < r; l += 3, r -= 3)
                for (int c = 0; c < 3; c++) {
                    unsigned char t = l[c];
                    l[c] = r[c];
                    r[c] = t;
                }
        }
    }
    free(padded);
    free(whole);
    return status;
}

/* An [h, w, 3] uint8 image whose pixels are packed (3 bytes apart, channels adjacent). */
static int image_view(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 3 || view->itemsize != 1 || view->shape[2] != 3 || view->strides[2] != 1 ||
        view->strides[1] != 3 || view->strides[0] <= 0 || view->shape[0] < 1 || view->shape[1] < 1 ||
        view->shape[0] > INT32_MAX / 4 || view->shape[1] > INT32_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "%s must be a non-empty uint8 [height, width, 3] array with packed pixels", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyObject *stoker_py_resample(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"src", "dst", "antialias", "simd", NULL};
    PyObject *src_obj, *dst_obj;
    int antialias = 1, simd = 2;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|pi", keywords, &src_obj, &dst_obj, &antialias, &simd))
        return NULL;
    Py_buffer src, dst;
    if (image_view(src_obj, &src, 0, "src") < 0)
        return NULL;
    if (image_view(dst_obj, &dst, 1, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = stoker_resample((const unsigned char *)src.buf, (int)src.shape[0], (int)src.shape[1], src.strides[0],
                             (unsigned char *)dst.buf, (int)dst.shape[0], (int)dst.shape[1], dst.strides[0],
                             antialias, simd);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}
