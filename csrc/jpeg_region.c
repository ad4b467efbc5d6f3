/*
 * stoker._jpeg: decode one rectangle of a JPEG at a DCT scale of n/8, with libjpeg-turbo's
 * partial-decode API (jpeg_crop_scanline + jpeg_skip_scanlines), into a caller's buffer.
 *
 * Rows above the rectangle are skipped (entropy-decoded only: no IDCT, upsampling or colour
 * conversion), rows below it are never read, and only the iMCU columns that cover it go through
 * the IDCT. The GIL is released for the whole decode.
 *
 * The library is not linked at build time: load() opens a libjpeg-turbo shared library (the one
 * Pillow's wheels ship, or the system's) and resolves the dozen functions used here, so the
 * extension builds with nothing but a C compiler and Python's headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jpeglib.h"

/* The functions used, resolved by load(). */
static struct {
    struct jpeg_error_mgr *(*std_error)(struct jpeg_error_mgr *);
    void (*create_decompress)(j_decompress_ptr, int, size_t);
    void (*destroy_decompress)(j_decompress_ptr);
    void (*mem_src)(j_decompress_ptr, const unsigned char *, unsigned long);
    int (*read_header)(j_decompress_ptr, boolean);
    boolean (*start_decompress)(j_decompress_ptr);
    void (*crop_scanline)(j_decompress_ptr, JDIMENSION *, JDIMENSION *);
    JDIMENSION (*skip_scanlines)(j_decompress_ptr, JDIMENSION);
    JDIMENSION (*read_scanlines)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
    void (*abort_decompress)(j_decompress_ptr);
} lib;
static void *lib_handle = NULL;

static PyObject *JpegError;       /* corrupt, truncated or otherwise undecodable data */
static PyObject *UnsupportedError; /* valid JPEG this path does not serve (CMYK, YCCK, ...) */
static PyObject *TooLargeError;    /* the header claims more pixels than max_pixels */

/* libjpeg reports errors through error_exit, which must not return: jump back to decode(). */
typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    err->pub.format_message(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (level -1: corrupt data the library can step over) are errors here, as simplejpeg's
 * strict mode treats them: a damaged image goes to the fallback decoder, which says what is wrong. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0)
        on_error(cinfo);
}

static void no_output(j_common_ptr cinfo) { (void)cinfo; }

#define RESOLVE(field, name)                                                   \
    do {                                                                       \
        *(void **)(&lib.field) = dlsym(handle, name);                          \
        if (lib.field == NULL) {                                               \
            PyErr_Format(PyExc_OSError, "%s has no %s (libjpeg-turbo >= 1.5 needed)", path, name); \
            dlclose(handle);                                                   \
            memset(&lib, 0, sizeof(lib));                                      \
            return NULL;                                                       \
        }                                                                      \
    } while (0)

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    if (lib_handle != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a libjpeg is already loaded");
        return NULL;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
        return NULL;
    }
    RESOLVE(std_error, "jpeg_std_error");
    RESOLVE(create_decompress, "jpeg_CreateDecompress");
    RESOLVE(destroy_decompress, "jpeg_destroy_decompress");
    RESOLVE(mem_src, "jpeg_mem_src");
    RESOLVE(read_header, "jpeg_read_header");
    RESOLVE(start_decompress, "jpeg_start_decompress");
    RESOLVE(crop_scanline, "jpeg_crop_scanline");
    RESOLVE(skip_scanlines, "jpeg_skip_scanlines");
    RESOLVE(read_scanlines, "jpeg_read_scanlines");
    RESOLVE(abort_decompress, "jpeg_abort_decompress");
    lib_handle = handle;
    Py_RETURN_NONE;
}

static PyObject *unload(PyObject *self, PyObject *args) {
    if (lib_handle != NULL)
        dlclose(lib_handle);
    lib_handle = NULL;
    memset(&lib, 0, sizeof(lib));
    Py_RETURN_NONE;
}

typedef struct {
    const unsigned char *data;
    unsigned long size;
    unsigned char *out;   /* (y1 - y0) rows of (x1 - x0) * 3 bytes */
    int scale;            /* n of n/8 */
    int fast;             /* fast integer IDCT, no fancy upsampling */
    JDIMENSION y0, y1, x0, x1;
    int pad;              /* columns decoded beyond each side, then dropped (see below) */
    double max_pixels;    /* refuse larger images before allocating anything for them */
    /* results */
    JDIMENSION height, width; /* the scaled image's size; the stored size when status is 5 */
    int status; /* 0 ok, 1 libjpeg error, 2 unsupported colour space, 3 window outside, 4 no memory, 5 too large */
} job_t;

/* Runs without the GIL; touches no Python object. */
static void run(job_t *job, error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    unsigned char *volatile row = NULL; /* volatile: read after longjmp */
    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = lib.std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->pub.output_message = no_output;
    if (setjmp(err->jump)) {
        job->status = 1;
        goto done;
    }
    lib.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
    lib.mem_src(&cinfo, job->data, job->size);
    lib.read_header(&cinfo, TRUE);
    if ((double)cinfo.image_width * (double)cinfo.image_height > job->max_pixels) {
        job->height = cinfo.image_height;
        job->width = cinfo.image_width;
        job->status = 5;
        goto done;
    }
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        job->status = 2;
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = (unsigned int)job->scale;
    cinfo.scale_denom = 8;
    cinfo.dct_method = job->fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = job->fast ? FALSE : TRUE;
    lib.start_decompress(&cinfo);
    job->height = cinfo.output_height;
    job->width = cinfo.output_width;
    if (job->y1 > cinfo.output_height || job->x1 > cinfo.output_width) {
        job->status = 3;
        goto done;
    }
    /* Fancy (smooth) chroma upsampling treats the edges of a partial row as image edges, so the
     * decoded columns reach `pad` beyond the window on each side: the window's own pixels are
     * then exactly those of a full decode. */
    JDIMENSION left = job->x0 > (JDIMENSION)job->pad ? job->x0 - job->pad : 0;
    JDIMENSION right = job->x1 + job->pad < cinfo.output_width ? job->x1 + job->pad : cinfo.output_width;
    JDIMENSION xoff = left, cw = right - left;
    if (left > 0 || right < cinfo.output_width)
        lib.crop_scanline(&cinfo, &xoff, &cw);  /* moves xoff left to an iMCU boundary */
    else
        xoff = 0;
    JDIMENSION skip = job->x0 - xoff;
    size_t out_stride = (size_t)(job->x1 - job->x0) * 3;
    row = (unsigned char *)malloc((size_t)cinfo.output_width * 3);
    if (row == NULL) {
        job->status = 4;
        goto done;
    }
    if (job->y0 > 0 && lib.skip_scanlines(&cinfo, job->y0) != job->y0) {
        job->status = 3;
        goto done;
    }
    for (JDIMENSION y = job->y0; y < job->y1; y++) {
        JSAMPROW rows[1] = {row};
        if (lib.read_scanlines(&cinfo, rows, 1) != 1) {
            snprintf(err->message, sizeof(err->message), "no scanline %u (image ends early)", y);
            job->status = 1;
            goto done;
        }
        memcpy(job->out + (size_t)(y - job->y0) * out_stride, row + (size_t)skip * 3, out_stride);
    }
    job->status = 0;
done:
    free(row);
    /* rows below the window are never decoded: abort rather than finish */
    lib.destroy_decompress(&cinfo);
}

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"data", "out", "scale", "y0", "y1", "x0", "x1", "fast", "pad", "max_pixels", NULL};
    Py_buffer data, out;
    job_t job;
    unsigned int y0, y1, x0, x1;
    memset(&job, 0, sizeof(job));
    job.pad = 2;
    job.max_pixels = 1e18;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*iIIII|pid", keywords, &data, &out, &job.scale,
                                     &y0, &y1, &x0, &x1, &job.fast, &job.pad, &job.max_pixels))
        return NULL;
    PyObject *result = NULL;
    if (lib_handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
        goto out;
    }
    if (job.scale < 1 || job.scale > 16 || y1 <= y0 || x1 <= x0 || job.pad < 0) {
        PyErr_Format(PyExc_ValueError, "bad request: scale %d/8, rows %u..%u, columns %u..%u",
                     job.scale, y0, y1, x0, x1);
        goto out;
    }
    if (!PyBuffer_IsContiguous(&out, 'C') || (size_t)out.len < (size_t)(y1 - y0) * (x1 - x0) * 3) {
        PyErr_Format(PyExc_ValueError, "out must be a C-contiguous buffer of at least %zu bytes",
                     (size_t)(y1 - y0) * (x1 - x0) * 3);
        goto out;
    }
    job.data = (const unsigned char *)data.buf;
    job.size = (unsigned long)data.len;
    job.out = (unsigned char *)out.buf;
    job.y0 = y0, job.y1 = y1, job.x0 = x0, job.x1 = x1;
    error_mgr *err = (error_mgr *)calloc(1, sizeof(error_mgr));
    if (err == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    run(&job, err);
    Py_END_ALLOW_THREADS
    switch (job.status) {
    case 0:
        result = Py_BuildValue("(II)", job.height, job.width);
        break;
    case 1:
        PyErr_SetString(JpegError, err->message);
        break;
    case 2:
        PyErr_SetString(UnsupportedError, "colour space other than YCbCr, RGB or grayscale");
        break;
    case 3:
        PyErr_Format(PyExc_ValueError, "rows %u..%u, columns %u..%u are outside the %ux%u image at scale %d/8",
                     y0, y1, x0, x1, job.height, job.width, job.scale);
        break;
    case 5:
        PyErr_Format(TooLargeError, "%ux%u = %llu pixels exceeds the limit of %llu", job.width, job.height,
                     (unsigned long long)job.width * job.height, (unsigned long long)job.max_pixels);
        break;
    default:
        PyErr_NoMemory();
    }
    free(err);
out:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open a libjpeg-turbo shared library (>= 1.5)."},
    {"unload", unload, METH_NOARGS, "unload(): close the library load() opened (no decode may be running)."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, out, scale, y0, y1, x0, x1, fast=False, pad=2, max_pixels=1e18) -> (height, width)\n\n"
     "Decode rows y0..y1, columns x0..x1 of the image scaled by scale/8 into out as RGB;\n"
     "return the scaled image's size. Raises JpegError, UnsupportedError or TooLargeError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    JpegError = PyErr_NewException("stoker._jpeg.JpegError", PyExc_ValueError, NULL);
    UnsupportedError = PyErr_NewException("stoker._jpeg.UnsupportedError", PyExc_ValueError, NULL);
    TooLargeError = PyErr_NewException("stoker._jpeg.TooLargeError", PyExc_ValueError, NULL);
    /* the module keeps one reference each, the statics another (never released: a module of one instance) */
    if (JpegError == NULL || UnsupportedError == NULL || TooLargeError == NULL ||
        PyModule_AddObjectRef(m, "JpegError", JpegError) < 0 ||
        PyModule_AddObjectRef(m, "UnsupportedError", UnsupportedError) < 0 ||
        PyModule_AddObjectRef(m, "TooLargeError", TooLargeError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
