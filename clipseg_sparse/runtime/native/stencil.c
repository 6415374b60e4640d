/* The product of a square-stencil CSR matrix with a dense block (methods/lposs.py's pixel Laplacian; built by
 * clipseg_sparse.runtime.native).
 *
 * The matrix is over the H x W pixels of an image, row-major; row (y, x) holds the entries of the in-image
 * pixels of the (2r + 1) x (2r + 1) square around it, in raster order (its columns ascending when W > 2r), so
 * only the values and row starts are read: the columns follow from the square. Each output row is summed in
 * that order. Why C: the sparse library's product reads an index per entry and keeps its sums in memory;
 * here the entries of a pixel are read once per 32 columns of the block, whose sums stay in registers.
 *
 * values, crow: the CSR arrays (crow int64, H*W + 1); p, q: H*W x B row-major, B a multiple of 8; rows
 * [y0, y1) of the image are computed (callers split the image over threads). */
#include <stddef.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* columns [b, b + 8 * N) of one output row */
#define CHUNK(N)                                                                            \
    static void chunk##N(const float *v, const float *corner, size_t row_step, int rows,   \
                         int cols, int B, float *out) {                                     \
        v8 acc[N];                                                                          \
        for (int c = 0; c < N; c++) acc[c] = (v8){0};                                       \
        for (int i = 0; i < rows; i++) {                                                    \
            const float *src = corner + i * row_step;                                       \
            for (int j = 0; j < cols; j++, src += B) {                                      \
                v8 w = (v8){0} + *v++;                                                      \
                for (int c = 0; c < N; c++) acc[c] += w * load8(src + 8 * c);               \
            }                                                                               \
        }                                                                                   \
        memcpy(out, acc, sizeof acc);                                                       \
    }
CHUNK(4)
CHUNK(1)

void square_stencil_product(const float *values, const long long *crow, const float *p, float *q, int H, int W,
                            int r, int B, int y0, int y1) {
    size_t row_step = (size_t)W * B;
    for (int y = y0; y < y1; y++) {
        int top = y < r ? y : r, bottom = y + r >= H ? H - 1 - y : r;
        for (int x = 0; x < W; x++) {
            int left = x < r ? x : r, right = x + r >= W ? W - 1 - x : r;
            size_t pixel = (size_t)y * W + x;
            const float *v = values + crow[pixel];
            const float *corner = p + ((size_t)(y - top) * W + (x - left)) * B;
            float *out = q + pixel * B;
            int b = 0;
            for (; b + 32 <= B; b += 32) chunk4(v, corner + b, row_step, top + bottom + 1, left + right + 1, B, out + b);
            for (; b < B; b += 8) chunk1(v, corner + b, row_step, top + bottom + 1, left + right + 1, B, out + b);
        }
    }
}
