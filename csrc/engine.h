/*
 * The native batch engine (engine.c) and what it uses of jpeg_region.c: a row's plan and its
 * region decode + resize + place + flip, callable from a thread that never holds the GIL.
 */
#ifndef STOKER_ENGINE_H
#define STOKER_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* One thread's decoder state: libjpeg's error manager and a scratch buffer that grows to the largest
 * region decoded, then stays. */
typedef struct {
    void *err;
    unsigned char *scratch;
    size_t scratch_size;
} stoker_decoder;

int stoker_decoder_init(stoker_decoder *decoder);
void stoker_decoder_free(stoker_decoder *decoder);
int stoker_jpeg_loaded(void);

/* One row's region decode + resize + place + flip (params: int64 [17], jpeg_region.c's P_* order): 0 written, else the
 * status the per-sample path takes over with. No GIL needed. */
unsigned char stoker_render_row(const int64_t *params, const unsigned char *data, size_t len, unsigned char *images,
                                Py_ssize_t rows, int oh, int ow, int antialias, int fast, double max_pixels,
                                stoker_decoder *decoder);

/* A row of stored raw pixels (height x width x 3) read in place, resized, placed and flipped: no decode. */
unsigned char stoker_render_raw(const int64_t *params, const unsigned char *data, size_t len, unsigned char *images,
                                Py_ssize_t rows, int oh, int ow, int antialias, double max_pixels);

/* One row's decode parameters from its plan, as the per-sample path computes them (jpeg_region.c). */
void stoker_plan_row(const double *box, const double *clip, const int64_t *grid, int64_t h, int64_t w,
                     const int64_t *size, unsigned char flip, int64_t row, int oh, int ow, int full_size,
                     double headroom, int64_t *p);

/* Adds the Engine type, plan_batch(), plan_gpu_rows(), gather_spans() and map_levels() to the module. */
int stoker_engine_add(PyObject *module);

#endif
