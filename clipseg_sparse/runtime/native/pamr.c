/* PAMR's iterations fused per image row (clipseg_sparse.stages.pamr; built by clipseg_sparse.runtime.native).
 *
 * Each iteration sets every pixel of every class to the sum over K neighbours of weight x neighbour value,
 * the neighbours read from a replicate-padded copy of the band. The sum runs in the torch path's order
 * (first neighbour's product, then each next one added with a fused multiply-add, as ATen's addcmul), so
 * the result is the same to the bit where both use FMA. Why C: torch's elementwise kernels make one pass
 * over the whole band per neighbour (16 per iteration); here each row's neighbours are summed while the
 * rows are in cache.
 *
 * a, b: `classes` planes of (H + 2P) x (W + 2P), a holding the band's values in its interior;
 * weights: K x H x W; out: classes x H x W; oy, ox: the K offsets, |offset| <= P. */
#include <stddef.h>
#include <string.h>

static void replicate_border(float *plane, int H, int W, int P) {
    int Wp = W + 2 * P;
    for (int y = P; y < P + H; y++) {
        float *row = plane + (size_t)y * Wp;
        for (int x = 0; x < P; x++) {
            row[x] = row[P];
            row[P + W + x] = row[P + W - 1];
        }
    }
    for (int y = 0; y < P; y++) {
        memcpy(plane + (size_t)y * Wp, plane + (size_t)P * Wp, sizeof(float) * Wp);
        memcpy(plane + (size_t)(P + H + y) * Wp, plane + (size_t)(P + H - 1) * Wp, sizeof(float) * Wp);
    }
}

void pamr_band(float *a, float *b, const float *weights, float *out, int classes, int H, int W, int P, int K,
               const int *oy, const int *ox, int iterations) {
    int Wp = W + 2 * P;
    size_t plane = (size_t)(H + 2 * P) * Wp, wplane = (size_t)H * W;
    for (int c = 0; c < classes; c++) replicate_border(a + c * plane, H, W, P);
    for (int it = 0; it < iterations; it++) {
        int last = it == iterations - 1;
        for (int y = 0; y < H; y++) {
            for (int c = 0; c < classes; c++) {
                float *restrict d = last ? out + ((size_t)c * H + y) * W : b + c * plane + (size_t)(y + P) * Wp + P;
                const float *s = a + c * plane + (size_t)(y + P) * Wp + P;
                const float *w = weights + (size_t)y * W;
                const float *restrict s0 = s + oy[0] * Wp + ox[0], *restrict w0 = w;
                for (int x = 0; x < W; x++) d[x] = s0[x] * w0[x];
                int k = 1;
                for (; k + 4 <= K; k += 4) {  /* four neighbours per pass over the row, added in order */
                    const float *restrict s1 = s + oy[k] * Wp + ox[k], *restrict w1 = w + k * wplane;
                    const float *restrict s2 = s + oy[k + 1] * Wp + ox[k + 1], *restrict w2 = w + (k + 1) * wplane;
                    const float *restrict s3 = s + oy[k + 2] * Wp + ox[k + 2], *restrict w3 = w + (k + 2) * wplane;
                    const float *restrict s4 = s + oy[k + 3] * Wp + ox[k + 3], *restrict w4 = w + (k + 3) * wplane;
                    for (int x = 0; x < W; x++) d[x] = (((d[x] + s1[x] * w1[x]) + s2[x] * w2[x]) + s3[x] * w3[x]) + s4[x] * w4[x];
                }
                for (; k < K; k++) {
                    const float *restrict s1 = s + oy[k] * Wp + ox[k], *restrict w1 = w + k * wplane;
                    for (int x = 0; x < W; x++) d[x] = d[x] + s1[x] * w1[x];
                }
            }
        }
        if (!last) {
            for (int c = 0; c < classes; c++) replicate_border(b + c * plane, H, W, P);
            float *t = a;
            a = b;
            b = t;
        }
    }
}
