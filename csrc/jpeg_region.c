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
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jpeglib.h"
#include "resample.h"
#include "engine.h"

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
    boolean (*resync_to_restart)(j_decompress_ptr, int);
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
    RESOLVE(resync_to_restart, "jpeg_resync_to_restart");
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
    int seek;             /* start at the restart marker before the window, when the file has them */
    /* results */
    JDIMENSION height, width; /* the scaled image's size; the stored size when status is 5 */
    int status; /* 0 ok, 1 libjpeg error, 2 unsupported colour space, 3 window outside, 4 no memory, 5 too large */
    int seeked;           /* 1 when the decode started at a restart marker */
} job_t;

/* ---- Seeking with restart markers ----
 * A baseline JPEG's entropy-coded data cannot be entered in the middle, so skipping rows above the
 * window still costs their Huffman decoding (most of a scaled decode's time). Restart markers
 * (DRI) reset the decoder's state, so when the file has them, decoding can start at the marker
 * that begins an MCU row above the window: the header is copied with the image height reduced by
 * the rows cut, followed by the entropy data from that marker on. One MCU row more than needed is
 * kept above the window, so smooth chroma upsampling sees the same neighbours as in a full decode. */

/* libjpeg's marker reader; the state fields are documented as visible to applications (jpegint.h) */
struct marker_reader_view {
    void (*reset_marker_reader)(j_decompress_ptr);
    int (*read_markers)(j_decompress_ptr);
    jpeg_marker_parser_method read_restart_marker;
    boolean saw_SOI;
    boolean saw_SOF;
    int next_restart_num;
    unsigned int discarded_bytes;
};

typedef struct {
    unsigned char *header; /* copy of SOI..SOS with the height patched (malloc'd) */
    size_t header_len;
    const unsigned char *tail; /* entropy data from the chosen restart interval on (not owned) */
    size_t tail_len;
    JDIMENSION cut_rows;   /* full-size rows removed from the top */
    JDIMENSION cut_out;    /* output rows (at the requested scale) removed from the top */
    int restart_num;       /* the number of the first restart marker the decoder will meet */
} seek_t;

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

static unsigned long gcd(unsigned long a, unsigned long b) {
    while (b) {
        unsigned long t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Fill `seek` when the window can start below the top of the file; return 0 (nothing allocated)
 * when it cannot: no restart markers, progressive or arithmetic coding, a window near the top, or
 * anything unexpected in the markers (the normal path then decodes and reports). */
static int plan_seek(const job_t *job, seek_t *seek) {
    const unsigned char *d = job->data;
    size_t n = job->size, pos = 2, sof = 0, sos_end = 0;
    unsigned height = 0, width = 0, ncomp = 0, scan_comps = 0, hmax = 1, vmax = 1, ri = 0, all_one = 1;
    if (job->y0 == 0 || job->scale < 1 || job->scale > 8 || n < 4 || d[0] != 0xFF || d[1] != 0xD8)
        return 0;
    while (pos + 4 <= n && !sos_end) {
        if (d[pos] != 0xFF)
            return 0;
        unsigned m = d[pos + 1];
        if (m == 0xFF) { /* fill byte */
            pos++;
            continue;
        }
        size_t len = be16(d + pos + 2);
        if (len < 2 || pos + 2 + len > n)
            return 0;
        const unsigned char *seg = d + pos + 4;
        if (m == 0xC0 || m == 0xC1) { /* baseline / extended sequential, Huffman */
            if (len < 8 || seg[0] != 8)
                return 0;
            height = be16(seg + 1);
            width = be16(seg + 3);
            ncomp = seg[5];
            if (len != 8 + 3 * (size_t)ncomp || (ncomp != 1 && ncomp != 3))
                return 0;
            for (unsigned c = 0; c < ncomp; c++) {
                unsigned h = seg[6 + 3 * c + 1] >> 4, v = seg[6 + 3 * c + 1] & 15;
                if (h < 1 || h > 4 || v < 1 || v > 4)
                    return 0;
                hmax = h > hmax ? h : hmax;
                vmax = v > vmax ? v : vmax;
                all_one &= h == 1 && v == 1;
            }
            sof = pos + 5; /* the height field */
        } else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            return 0; /* progressive, lossless, hierarchical or arithmetic-coded */
        } else if (m == 0xDD) {
            if (len != 4)
                return 0;
            ri = be16(seg);
        } else if (m == 0xDA) {
            scan_comps = seg[0];
            sos_end = pos + 2 + len;
        } else if (m == 0xD9 || (m >= 0xD0 && m <= 0xD8) || m == 0x01 || m == 0xDC) {
            return 0; /* EOI, stray RST/SOI/TEM or DNL before the scan */
        }
        pos += 2 + len;
    }
    /* one interleaved scan of every component (single-component: one block per MCU) */
    if (!sos_end || !sof || !ri || !height || !width || scan_comps != ncomp || (ncomp == 1 && !all_one))
        return 0;
    unsigned long mcu_h = 8UL * vmax, mcu_w = 8UL * hmax;
    unsigned long per_row = (width + mcu_w - 1) / mcu_w;
    unsigned long rows = (height + mcu_h - 1) / mcu_h;
    unsigned long step = ri / gcd(ri, per_row); /* MCU rows between restart boundaries that start a row */
    unsigned long out_h = (unsigned long)vmax * (unsigned long)job->scale; /* output rows per MCU row */
    unsigned long first = job->y0 / out_h;
    if (first < 2)
        return 0;
    unsigned long r0 = ((first - 1) / step) * step; /* one MCU row of context above the window */
    if (r0 == 0 || r0 >= rows)
        return 0;
    unsigned long k = r0 * per_row / ri; /* restart markers to pass */
    size_t p = sos_end;
    unsigned long count = 0;
    while (count < k) {
        const unsigned char *f = memchr(d + p, 0xFF, n - p);
        if (f == NULL)
            return 0;
        p = (size_t)(f - d);
        if (p + 1 >= n)
            return 0;
        unsigned c = d[p + 1];
        if (c == 0x00) {
            p += 2; /* stuffed byte */
        } else if (c == 0xFF) {
            p += 1; /* fill byte */
        } else if (c >= 0xD0 && c <= 0xD7 && c - 0xD0 == (count & 7)) {
            count++;
            p += 2;
        } else {
            return 0; /* EOI or a marker out of sequence: let the normal path deal with it */
        }
    }
    seek->header = (unsigned char *)malloc(sos_end);
    if (seek->header == NULL)
        return 0;
    memcpy(seek->header, d, sos_end);
    unsigned new_height = height - (unsigned)(r0 * mcu_h);
    seek->header[sof] = (unsigned char)(new_height >> 8);
    seek->header[sof + 1] = (unsigned char)(new_height & 0xFF);
    seek->header_len = sos_end;
    seek->tail = d + p;
    seek->tail_len = n - p;
    seek->cut_rows = (JDIMENSION)(r0 * mcu_h);
    seek->cut_out = (JDIMENSION)(r0 * out_h);
    seek->restart_num = (int)(k & 7);
    return 1;
}

/* A source manager over two pieces: the patched header, then the original entropy data. */
typedef struct {
    struct jpeg_source_mgr pub;
    const unsigned char *next;
    size_t next_len;
} two_piece_src;

static void src_noop(j_decompress_ptr cinfo) { (void)cinfo; }

static boolean src_fill(j_decompress_ptr cinfo) {
    two_piece_src *src = (two_piece_src *)cinfo->src;
    if (src->next == NULL) { /* data ends before the decoder is done: the same error a full decode gives */
        error_mgr *err = (error_mgr *)cinfo->err;
        snprintf(err->message, sizeof(err->message), "Premature end of JPEG file");
        longjmp(err->jump, 1);
    }
    src->pub.next_input_byte = src->next;
    src->pub.bytes_in_buffer = src->next_len;
    src->next = NULL;
    return TRUE;
}

static void src_skip(j_decompress_ptr cinfo, long count) {
    two_piece_src *src = (two_piece_src *)cinfo->src;
    while (count > 0 && (size_t)count > src->pub.bytes_in_buffer) {
        count -= (long)src->pub.bytes_in_buffer;
        src_fill(cinfo);
    }
    if (count > 0) {
        src->pub.next_input_byte += count;
        src->pub.bytes_in_buffer -= (size_t)count;
    }
}

static void use_two_pieces(j_decompress_ptr cinfo, two_piece_src *src, const seek_t *seek) {
    memset(src, 0, sizeof(*src));
    src->pub.init_source = src_noop;
    src->pub.fill_input_buffer = src_fill;
    src->pub.skip_input_data = src_skip;
    src->pub.resync_to_restart = lib.resync_to_restart;
    src->pub.term_source = src_noop;
    src->pub.next_input_byte = seek->header;
    src->pub.bytes_in_buffer = seek->header_len;
    src->next = seek->tail;
    src->next_len = seek->tail_len;
    cinfo->src = &src->pub;
}

/* Runs without the GIL; touches no Python object. */
static void run(job_t *job, error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    unsigned char *volatile row = NULL; /* volatile: read after longjmp */
    two_piece_src src;
    seek_t seek;
    memset(&seek, 0, sizeof(seek));
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
    if (job->seek && plan_seek(job, &seek)) {
        use_two_pieces(&cinfo, &src, &seek);
        job->seeked = 1;
    } else {
        lib.mem_src(&cinfo, job->data, job->size);
    }
    lib.read_header(&cinfo, TRUE);
    if (job->seeked) /* the first marker met is the one after the interval we start at */
        ((struct marker_reader_view *)cinfo.marker)->next_restart_num = seek.restart_num;
    if ((double)cinfo.image_width * ((double)cinfo.image_height + seek.cut_rows) > job->max_pixels) {
        job->height = cinfo.image_height + seek.cut_rows;
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
    job->height = cinfo.output_height + seek.cut_out;
    job->width = cinfo.output_width;
    if (job->y1 > job->height || job->x1 > cinfo.output_width) {
        job->status = 3;
        goto done;
    }
    JDIMENSION y0 = job->y0 - seek.cut_out, y1 = job->y1 - seek.cut_out; /* rows of what is decoded */
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
    if (y0 > 0 && lib.skip_scanlines(&cinfo, y0) != y0) {
        job->status = 3;
        goto done;
    }
    for (JDIMENSION y = y0; y < y1; y++) {
        JSAMPROW rows[1] = {row};
        if (lib.read_scanlines(&cinfo, rows, 1) != 1) {
            snprintf(err->message, sizeof(err->message), "no scanline %u (image ends early)", y);
            job->status = 1;
            goto done;
        }
        memcpy(job->out + (size_t)(y - y0) * out_stride, row + (size_t)skip * 3, out_stride);
    }
    job->status = 0;
done:
    free(row);
    free(seek.header);
    /* rows below the window are never decoded: abort rather than finish */
    lib.destroy_decompress(&cinfo);
}

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"data", "out", "scale", "y0", "y1", "x0", "x1", "fast", "pad", "max_pixels", "seek", NULL};
    Py_buffer data, out;
    job_t job;
    unsigned int y0, y1, x0, x1;
    memset(&job, 0, sizeof(job));
    job.pad = 2;
    job.max_pixels = 1e18;
    job.seek = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*iIIII|pidp", keywords, &data, &out, &job.scale,
                                     &y0, &y1, &x0, &x1, &job.fast, &job.pad, &job.max_pixels, &job.seek))
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
        result = Py_BuildValue("(IIO)", job.height, job.width, job.seeked ? Py_True : Py_False);
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

/* ---- One row of a batch, for the engine's pool threads ----
 * Region-decode at a DCT scale, pad, resample, place and mirror straight into the row of the batch
 * (stoker_place), no GIL needed. A row that fails anywhere gets a non-zero status and is left for the
 * caller's per-sample path, which decodes it again and says what is wrong (or falls back to a
 * whole-image decode). */
enum { P_ROW, P_H, P_W, P_SCALE, P_Y0, P_Y1, P_X0, P_X1, P_PT, P_PB, P_PL, P_PR, P_RH, P_RW, P_PY, P_PX, P_FLIP,
       NPARAM };

static unsigned char render_one(const int64_t *p, const Py_buffer *data, unsigned char *images, Py_ssize_t rows,
                                int oh, int ow, int antialias, int fast, double max_pixels, error_mgr *err,
                                unsigned char **scratch, size_t *scratch_size) {
    int64_t n = p[P_SCALE];
    if (p[P_ROW] < 0 || p[P_ROW] >= rows || n < 1 || n > 8 || p[P_Y0] < 0 || p[P_Y1] <= p[P_Y0] ||
        p[P_X0] < 0 || p[P_X1] <= p[P_X0] || p[P_RH] < 1 || p[P_RW] < 1 || p[P_Y1] > INT32_MAX ||
        p[P_X1] > INT32_MAX || p[P_RH] > INT32_MAX || p[P_RW] > INT32_MAX)
        return 20;
    /* the stored size is data too: over max_pixels nothing is allocated for it (the per-sample path says so) */
    if ((double)p[P_H] * (double)p[P_W] > max_pixels)
        return 5;
    size_t need = (size_t)(p[P_Y1] - p[P_Y0]) * (size_t)(p[P_X1] - p[P_X0]) * 3;
    if (need > *scratch_size) {
        unsigned char *grown = (unsigned char *)realloc(*scratch, need);
        if (grown == NULL)
            return 4;
        *scratch = grown;
        *scratch_size = need;
    }
    job_t job;
    memset(&job, 0, sizeof(job));
    job.data = (const unsigned char *)data->buf;
    job.size = (unsigned long)data->len;
    job.out = *scratch;
    job.scale = (int)n;
    job.fast = fast;
    job.pad = 2;
    job.max_pixels = max_pixels;
    job.seek = 1;
    job.y0 = (JDIMENSION)p[P_Y0], job.y1 = (JDIMENSION)p[P_Y1];
    job.x0 = (JDIMENSION)p[P_X0], job.x1 = (JDIMENSION)p[P_X1];
    run(&job, err);
    if (job.status != 0)
        return (unsigned char)job.status;
    /* the header must give the stored size at this scale (else the per-sample path reports it) */
    if ((int64_t)job.height != (p[P_H] * n + 7) / 8 || (int64_t)job.width != (p[P_W] * n + 7) / 8)
        return 21;
    int pad[4] = {(int)p[P_PT], (int)p[P_PB], (int)p[P_PL], (int)p[P_PR]};
    unsigned char *dst = images + (size_t)p[P_ROW] * (size_t)oh * (size_t)ow * 3;
    if (stoker_place(*scratch, (int)(p[P_Y1] - p[P_Y0]), (int)(p[P_X1] - p[P_X0]), (ptrdiff_t)(p[P_X1] - p[P_X0]) * 3,
                     pad, (int)p[P_RH], (int)p[P_RW], (int)p[P_PY], (int)p[P_PX], dst, oh, ow, (ptrdiff_t)ow * 3,
                     (int)p[P_FLIP], antialias) < 0)
        return 4;
    return 0;
}

unsigned char stoker_render_row(const int64_t *params, const unsigned char *data, size_t len, unsigned char *images,
                                Py_ssize_t rows, int oh, int ow, int antialias, int fast, double max_pixels,
                                stoker_decoder *decoder) {
    Py_buffer view;
    memset(&view, 0, sizeof(view));
    view.buf = (void *)data;
    view.len = (Py_ssize_t)len;
    return render_one(params, &view, images, rows, oh, ow, antialias, fast, max_pixels, (error_mgr *)decoder->err,
                      &decoder->scratch, &decoder->scratch_size);
}

unsigned char stoker_render_raw(const int64_t *p, const unsigned char *data, size_t len, unsigned char *images,
                                Py_ssize_t rows, int oh, int ow, int antialias, double max_pixels) {
    /* stored pixels (height x width x 3, RGB): the window is read in place, at full scale (p's scale 8) */
    if (p[P_ROW] < 0 || p[P_ROW] >= rows || p[P_SCALE] != 8 || p[P_Y0] < 0 || p[P_Y1] <= p[P_Y0] || p[P_X0] < 0 ||
        p[P_X1] <= p[P_X0] || p[P_Y1] > p[P_H] || p[P_X1] > p[P_W] || p[P_RH] < 1 || p[P_RW] < 1 ||
        p[P_RH] > INT32_MAX || p[P_RW] > INT32_MAX || p[P_W] > INT32_MAX / 3)
        return 20;
    if ((double)p[P_H] * (double)p[P_W] > max_pixels)
        return 5;
    if ((double)len != (double)p[P_H] * (double)p[P_W] * 3.0)
        return 21;   /* not the stored size's bytes: the per-sample path says so */
    ptrdiff_t stride = (ptrdiff_t)p[P_W] * 3;
    const unsigned char *region = data + (size_t)p[P_Y0] * (size_t)stride + (size_t)p[P_X0] * 3;
    int pad[4] = {(int)p[P_PT], (int)p[P_PB], (int)p[P_PL], (int)p[P_PR]};
    unsigned char *dst = images + (size_t)p[P_ROW] * (size_t)oh * (size_t)ow * 3;
    if (stoker_place(region, (int)(p[P_Y1] - p[P_Y0]), (int)(p[P_X1] - p[P_X0]), stride, pad, (int)p[P_RH],
                     (int)p[P_RW], (int)p[P_PY], (int)p[P_PX], dst, oh, ow, (ptrdiff_t)ow * 3, (int)p[P_FLIP],
                     antialias) < 0)
        return 4;
    return 0;
}

int stoker_decoder_init(stoker_decoder *decoder) {
    decoder->err = calloc(1, sizeof(error_mgr));
    decoder->scratch = NULL;
    decoder->scratch_size = 0;
    return decoder->err == NULL ? -1 : 0;
}

void stoker_decoder_free(stoker_decoder *decoder) {
    free(decoder->err);
    free(decoder->scratch);
    decoder->err = NULL;
    decoder->scratch = NULL;
    decoder->scratch_size = 0;
}

int stoker_jpeg_loaded(void) { return lib_handle != NULL; }

/* ---- A batch's per-row parameters ----
 * The maths of geometry.decode_minimums, codecs.jpeg_scale_eighths and geometry.resampling (its
 * `_axis`), operation for operation in double precision (no fused multiply-add: -ffp-contract=off;
 * Python's round() is rint's half-to-even), so each row gets exactly the integers the per-sample path
 * computes; tests/test_engine.py compares the engine's batches with that path's, bit for bit. */
static void plan_axis(double b0, double blen, double c0, double clen, int64_t g, int64_t s, double f, int trim,
                      int64_t *out) {  /* out: w0, w1, pad0, pad1, resampled length, place */
    double c0s = c0 * f, c1s = (c0 + clen) * f;
    int64_t r0 = (int64_t)rint(c0s), r1 = (int64_t)rint(c1s);
    int64_t w0 = r0 > 0 ? r0 : 0;
    w0 = w0 < s - 1 ? w0 : s - 1;
    int64_t w1 = r1 > w0 + 1 ? r1 : w0 + 1;
    w1 = w1 < s ? w1 : s;
    int64_t out0 = (int64_t)rint((b0 - c0) * (double)g / (clen >= 1e-9 ? clen : 1e-9));
    int64_t pad0 = w0 - r0 > 0 ? w0 - r0 : 0, pad1 = r1 - w1 > 0 ? r1 - w1 : 0;
    if (pad0 || pad1) {
        out[0] = w0, out[1] = w1, out[2] = pad0, out[3] = pad1, out[4] = g, out[5] = -out0;
        return;
    }
    double span = c1s - c0s, k = (double)g / (span >= 1e-9 ? span : 1e-9);
    if (trim) {
        double inv = 1.0 / k, margin = 2.0 * (1.0 >= inv ? 1.0 : inv) + 1.0;
        int64_t lo = (int64_t)floor(b0 * f - margin), hi = (int64_t)ceil((b0 + blen) * f + margin);
        lo = w0 > lo ? w0 : lo;
        hi = w1 < hi ? w1 : hi;
        if (hi > lo)
            w0 = lo, w1 = hi;
    }
    int64_t g0 = (int64_t)rint(((double)w0 - c0s) * k), g1 = (int64_t)rint(((double)w1 - c0s) * k);
    g1 = g1 > g0 + 1 ? g1 : g0 + 1;
    out[0] = w0, out[1] = w1, out[2] = 0, out[3] = 0, out[4] = g1 - g0, out[5] = g0 - out0;
}

static int64_t scale_eighths(int64_t h, int64_t w, int64_t mh, int64_t mw) {
    if (mh <= 0 && mw <= 0)
        return 8;
    for (int64_t n = 1; n < 8; n *= 2)
        if (ceil((double)(h * n) / 8.0) >= (double)mh && ceil((double)(w * n) / 8.0) >= (double)mw)
            return n;
    return 8;
}

void stoker_plan_row(const double *box, const double *clip, const int64_t *grid, int64_t h, int64_t w,
                     const int64_t *size, unsigned char flip, int64_t row, int oh, int ow, int full_size,
                     double headroom, int64_t *p) {
    int64_t mh = h, mw = w;
    if (!full_size) {
        double bh = box[2] >= 1e-9 ? box[2] : 1e-9, bw = box[3] >= 1e-9 ? box[3] : 1e-9;
        int64_t ch = (int64_t)ceil((double)(h * oh) * headroom / bh - 1e-6);
        int64_t cw = (int64_t)ceil((double)(w * ow) * headroom / bw - 1e-6);
        mh = h < ch ? h : ch, mw = w < cw ? w : cw;
    }
    int64_t n = scale_eighths(h, w, mh, mw);
    int64_t sh = (int64_t)ceil((double)(h * n) / 8.0), sw = (int64_t)ceil((double)(w * n) / 8.0);
    int64_t y[6], x[6];
    plan_axis(box[0], box[2], clip[0], clip[2], grid[0], sh, (double)sh / (double)h, n < 8, y);
    plan_axis(box[1], box[3], clip[1], clip[3], grid[1], sw, (double)sw / (double)w, n < 8, x);
    int served = size[0] == oh && size[1] == ow && h > 0 && w > 0;
    int64_t v[NPARAM] = {served ? row : -1, h, w, n, y[0], y[1], x[0], x[1], y[2], y[3], x[2], x[3], y[4], x[4],
                         y[5], x[5], flip != 0};
    memcpy(p, v, sizeof(v));
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open a libjpeg-turbo shared library (>= 1.5)."},
    {"unload", unload, METH_NOARGS, "unload(): close the library load() opened (no decode may be running)."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, out, scale, y0, y1, x0, x1, fast=False, pad=2, max_pixels=1e18, seek=True)\n"
     "    -> (height, width, seeked)\n\n"
     "Decode rows y0..y1, columns x0..x1 of the image scaled by scale/8 into out as RGB;\n"
     "return the scaled image's size and whether decoding started at a restart marker.\n"
     "Raises JpegError, UnsupportedError or TooLargeError."},
    {"resample", (PyCFunction)(void (*)(void))stoker_py_resample, METH_VARARGS | METH_KEYWORDS,
     "resample(src, dst, antialias=True, simd=2)\n\n"
     "Resize the uint8 [h, w, 3] image src into dst (its own height and width) exactly as torchvision's\n"
     "bilinear resize of a uint8 tensor does (see csrc/resample.c); rows of either may be strided.\n"
     "simd: 2 the best SIMD the CPU has, 1 at most SSSE3, 0 the portable loops (the same pixels; for tests)."},
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
        PyModule_AddObjectRef(m, "TooLargeError", TooLargeError) < 0 || stoker_engine_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* Safe without the GIL: load() and unload() write the function table and lib_handle, but stoker
     * calls them only under _libjpeg's lock, before the module is handed to any decoding thread (and
     * never unload() while a decode runs); decode() reads that table and touches nothing shared
     * besides (its job, error manager and libjpeg object are its own); the exception types above
     * are set once, here. The batch
     * engine (engine.c) keeps its state per Engine object, under that object's own mutex, and its pool
     * threads never touch a Python object. */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
