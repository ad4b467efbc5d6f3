/*
 * The uint8 bilinear resize of torchvision's `resize(antialias=True)` (libtorch's
 * _upsample_bilinear2d_aa on uint8, channels last) and of `antialias=False` (upsample_bilinear2d),
 * pixel for pixel, on packed RGB (3 bytes per pixel, any row stride). See resample.c.
 */
#ifndef STOKER_RESAMPLE_H
#define STOKER_RESAMPLE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

/* Resample src (sh x sw RGB, rows src_stride bytes apart) into dst (dh x dw, rows dst_stride bytes
 * apart); simd: 2 the best SIMD the CPU has, 1 at most SSSE3, 0 the portable loops (the same
 * pixels every time). Returns 0, or -1 when out of memory.
 * Touches no Python object: call it without the GIL. */
int stoker_resample(const unsigned char *src, int sh, int sw, ptrdiff_t src_stride, unsigned char *dst,
                    int dh, int dw, ptrdiff_t dst_stride, int antialias, int simd);

/* Geometry's resample_region_into: `region` (h x w) with pad = (top, bottom, left, right) zero rows
 * and columns around it, resampled to rh x rw, its top-left placed at (py, px) of dst (oh x ow; may
 * be negative: only part of it is kept), zeros where nothing lands, then mirrored left-right when
 * `flip`. Returns 0, or -1 when out of memory. No GIL needed. */
int stoker_place(const unsigned char *region, int h, int w, ptrdiff_t stride, const int pad[4], int rh, int rw,
                 int py, int px, unsigned char *dst, int oh, int ow, ptrdiff_t dst_stride, int flip, int antialias);

/* resample(src, dst, antialias=True, simd=2): the Python entry (numpy arrays [h, w, 3] uint8, rows may be
 * strided), GIL released for the work. */
PyObject *stoker_py_resample(PyObject *self, PyObject *args, PyObject *kwargs);

#endif
