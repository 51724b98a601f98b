/* Interleaved layouts: the file's blocks of eight weight rows rearranged, so that one 8-bit
 * dot instruction computes four values of all eight rows against one broadcast group of four
 * activations (the kernels are in interleaved.c).
 *
 * Every layout holds exactly the file's bytes per block, in another order, so a matrix is
 * rearranged in place and its size is unchanged. A group is 8 rows x one block (32 values for
 * Q8_0 and Q5_0, 256 for the K types); the groups of rows 8g..8g+7 lie block after block, in
 * segments of SEGMENT values (llorch.h says why and where each block lies).
 * Within a group, "a step" is 32 bytes: for rows r = 0..7, four consecutive values each
 * (byte 4r + e is value 4c + e of row r, for step c). Quantized values are stored unsigned
 * (what the instruction takes); the kernels take the offset back out with the activation sums.
 *
 * Q8_0_R8 (272 bytes): the 8 float16 scales, then steps 0..7, each value + 128.
 * Q5_0_R8 (176): the 8 scales; 4 x 32 bytes whose low nibbles are steps 0..3 and high nibbles
 *   steps 4..7 (the low 4 bits of each value); then the fifth bits as 32 bytes laid out as a step,
 *   bit c of byte 4r + e the fifth bit of value 4c + e of row r: step c's fifth bits are one shift
 *   and one mask of those bytes away, in place (where a 32-bit mask per step took six operations to
 *   spread over a step's bytes without AVX-512's mask registers). Measured (Zen 4, two threads, in
 *   cache, same bits): AVX2 one row 21.2 -> 27.3 GB/s, 512 rows 121 -> 143 GMAC/s; VNNI one row
 *   46.8 -> 52.4 GB/s.
 * Q4_K_R8 (1152): the 8 scales d, the 8 minimum scales, the 12 packed scale bytes as three
 *   32-byte planes (bytes 0-3, 4-7, 8-11 of each row, [byte][row]); then per pair of
 *   sub-blocks, 8 steps whose low nibbles are the first sub-block and high nibbles the second
 *   (this is the file's own nibble pairing, so those bytes only move).
 * Q6_K_R8 (1680): the 8 scales d, the 16 sub-block scales as [sub-block][row]; then per 32
 *   values, 4 x 32 bytes of low nibbles (steps 0-3 low, 4-7 high) and 2 x 32 bytes of the
 *   2-bit high parts (steps 0-3, then 4-7, two bits per step).
 */
#include "llorch.h"

#define ROWS 8

int llorch_repacked_type(int type, int64_t rows) {
#ifdef LLORCH_AVX2 /* the kernels: interleaved.c with VNNI, interleaved_avx2.c without */
    const int repacked = type + REPACKED;
    if (rows % ROWS == 0 && llorch_group_bytes(repacked) != 0) return repacked;
#else
    (void)rows;
#endif
    return type;
}

static uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t u32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Value y's 6-bit quant (0..63) in a Q6_K file block, and its inverse (ggml's order:
 * two halves of 128 values, each four quadrants of 32 sharing ql and qh bytes). */
static void q6_place(int y, int *ql, int *ql_shift, int *qh, int *qh_shift) {
    const int half = y / 128, quadrant = (y % 128) / 32, l = y % 32;
    *ql = 64 * half + 32 * (quadrant & 1) + l;
    *ql_shift = quadrant >= 2 ? 4 : 0;
    *qh = 128 + 32 * half + l;
    *qh_shift = 2 * quadrant;
}

static void q6_set(uint8_t *blk, int y, int q) {
    int ql, ls, qh, hs;
    q6_place(y, &ql, &ls, &qh, &hs);
    blk[ql] = (uint8_t)((blk[ql] & ~(15 << ls)) | ((q & 15) << ls));
    blk[qh] = (uint8_t)((blk[qh] & ~(3 << hs)) | (((q >> 4) & 3) << hs));
}

/* Byte `e` of row `r` in step `c` of a group part starting at `p`. */
#define AT(p, c, r, e) ((p)[(c) * 32 + (r) * 4 + (e)])

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void or32(uint8_t *p, uint32_t v) { put32(p, u32_at(p) | v); }

/* One group from its eight file blocks (rows[r] points at row r's block), into `out`, which
 * starts zeroed. A step holds four consecutive values of each row, so each row's part of a step
 * is one 32-bit word, moved whole: byte by byte, repacking took 0.3 s of every start. */
static void pack(int type, const uint8_t *const rows[ROWS], uint8_t *out) {
    for (int r = 0; r < ROWS; r++) {
        const uint8_t *b = rows[r];
        switch (type) {
            case T_Q8_0_R8:
                memcpy(out + 2 * r, b, 2);
                for (int c = 0; c < QK / 4; c++) put32(&AT(out + 16, c, r, 0), u32_at(b + 2 + 4 * c) ^ 0x80808080u);
                break;
            case T_Q5_0_R8: {
                memcpy(out + 2 * r, b, 2);
                for (int c = 0; c < 4; c++) put32(&AT(out + 16, c, r, 0), u32_at(b + 6 + 4 * c));
                const uint32_t fifth = u32_at(b + 2);
                for (int y = 0; y < QK; y++) AT(out + 144, 0, r, y % 4) |= (uint8_t)(((fifth >> y) & 1u) << (y / 4));
                break;
            }
            case T_Q4_K_R8:
                memcpy(out + 2 * r, b, 2);
                memcpy(out + 16 + 2 * r, b + 2, 2);
                for (int j = 0; j < 12; j++) out[32 + (j / 4) * 32 + (j % 4) * 8 + r] = b[4 + j];
                for (int c = 0; c < 32; c++) put32(&AT(out + 128, c, r, 0), u32_at(b + 16 + 4 * c));
                break;
            case T_Q6_K_R8:
                memcpy(out + 2 * r, b + 208, 2);
                for (int s = 0; s < 16; s++) out[16 + s * 8 + r] = b[192 + s];
                /* Four consecutive values share a quadrant, so their low and high parts are four
                 * consecutive bytes each in the file block (q6_place). */
                for (int y = 0; y < QK_K; y += 4) {
                    int ql, ls, qh, hs;
                    q6_place(y, &ql, &ls, &qh, &hs);
                    const uint32_t low = (u32_at(b + ql) >> ls) & 0x0F0F0F0Fu;
                    const uint32_t high = (u32_at(b + qh) >> hs) & 0x03030303u;
                    const int block = y / 32, c = (y % 32) / 4;
                    uint8_t *part = out + 144 + block * 192;
                    or32(&AT(part, c % 4, r, 0), low << (c < 4 ? 0 : 4));
                    or32(&AT(part + 128, c / 4, r, 0), high << (2 * (c % 4)));
                }
                break;
        }
    }
}

/* Row `r`'s file block back out of a group. */
static void unpack(int type, const uint8_t *group, int r, uint8_t *b) {
    switch (type) {
        case T_Q8_0_R8:
            memcpy(b, group + 2 * r, 2);
            for (int y = 0; y < QK; y++) b[2 + y] = (uint8_t)(AT(group + 16, y / 4, r, y % 4) ^ 0x80);
            break;
        case T_Q5_0_R8: {
            uint32_t qh = 0;
            for (int y = 0; y < QK; y++) qh |= (uint32_t)((AT(group + 144, 0, r, y % 4) >> (y / 4)) & 1) << y;
            memcpy(b, group + 2 * r, 2);
            memcpy(b + 2, &qh, 4);
            for (int y = 0; y < 16; y++) b[6 + y] = AT(group + 16, y / 4, r, y % 4);
            break;
        }
        case T_Q4_K_R8:
            memcpy(b, group + 2 * r, 2);
            memcpy(b + 2, group + 16 + 2 * r, 2);
            for (int j = 0; j < 12; j++) b[4 + j] = group[32 + (j / 4) * 32 + (j % 4) * 8 + r];
            for (int i = 0; i < 128; i++) b[16 + i] = AT(group + 128, i / 4, r, i % 4);
            break;
        case T_Q6_K_R8:
            memcpy(b + 208, group + 2 * r, 2);
            for (int s = 0; s < 16; s++) b[192 + s] = group[16 + s * 8 + r];
            for (int y = 0; y < QK_K; y++) {
                const int block = y / 32, c = (y % 32) / 4, e = y % 4;
                const uint8_t *part = group + 144 + block * 192;
                const int low = (AT(part, c % 4, r, e) >> (c < 4 ? 0 : 4)) & 15;
                const int high = (AT(part + 128, c / 4, r, e) >> (2 * (c % 4))) & 3;
                q6_set(b, y, low | high << 4);
            }
            break;
    }
}

/* A group of eight rows holds the same bytes before and after (blocks x 8 x block bytes). In one
 * segment (k <= SEGMENT) each group is copied aside and packed back over itself: copying the whole
 * matrix instead cost a transient as large as the vocabulary projection (170 MiB on the default
 * model, 640 values a row). Wider matrices scatter each group's blocks over the segments, so the
 * whole matrix is copied aside first. 0, or -1 when the copies cannot be allocated (nothing is
 * changed then). */
int llorch_repack(int type, uint8_t *data, int64_t rows, int64_t k) {
    const int64_t values = llorch_block_values(type), blocks = k / values, group = llorch_group_bytes(type);
    const int64_t block_bytes = group / ROWS, span = blocks * group, groups = rows / ROWS;
    const int whole = k > SEGMENT; /* the matrix copied aside, not group by group */
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    uint8_t *copies = llorch_alloc((size_t)(span * (whole ? groups : threads)));
    if (copies == NULL) return -1;
    if (whole) {
        memcpy(copies, data, (size_t)(span * groups));
        memset(data, 0, (size_t)(span * groups));
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; g++) {
#ifdef _OPENMP
        uint8_t *copy = whole ? copies + g * span : copies + (int64_t)omp_get_thread_num() * span;
#else
        uint8_t *copy = whole ? copies + g * span : copies;
#endif
        if (!whole) {
            memcpy(copy, data + g * span, (size_t)span);
            memset(data + g * span, 0, (size_t)span);
        }
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *sources[ROWS];
            for (int r = 0; r < ROWS; r++) sources[r] = copy + (r * blocks + b) * block_bytes;
            pack(type, sources, data + llorch_block_at(group, values, groups, k, g, b));
        }
    }
    free(copies);
    return 0;
}

void llorch_matrix_row(int type, const uint8_t *data, int64_t rows, int64_t k, int64_t r, float *out) {
    const int64_t group = llorch_group_bytes(type);
    if (group == 0) {
        llorch_dequantize_row(type, data + r * llorch_row_bytes(type, k), k, out);
        return;
    }
    const int64_t values = llorch_block_values(type), blocks = k / values;
    uint8_t block[210];
    for (int64_t b = 0; b < blocks; b++) {
        unpack(type, data + llorch_block_at(group, values, rows / ROWS, k, r / ROWS, b), (int)(r % ROWS), block);
        llorch_dequantize_row(type - REPACKED, block, values, out + b * values);
    }
}
