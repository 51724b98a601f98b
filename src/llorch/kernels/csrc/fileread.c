/* Reading a model file's tensors into their places in memory, in one call.
 *
 * ctypes releases Python's lock for the whole of a call, so a warm start runs this read
 * (about a second, mostly faulting in fresh huge pages) on one core while the tokenizer
 * parses on the other, holding that lock throughout. A Python loop of reads would wait
 * for the lock after its first tensor until the parse ended.
 */
#define _POSIX_C_SOURCE 200809L  /* pread under -std=c11 */

#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* Reads count ranges (offsets[i], sizes[i]) of fd into targets[i], in order. Returns -1 when
 * every range was read whole, else the index of the first range that was not: the file ended
 * inside it (*error is 0) or a read failed (*error is its errno). */
int64_t llorch_read_ranges(int fd, int64_t count, const int64_t *offsets, const int64_t *sizes,
                           char *const *targets, int *error) {
    *error = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t done = 0;
        while (done < sizes[i]) {
            ssize_t got = pread(fd, targets[i] + done, (size_t)(sizes[i] - done), (off_t)(offsets[i] + done));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                *error = got < 0 ? errno : 0;
                return i;
            }
            done += got;
        }
    }
    return -1;
}
