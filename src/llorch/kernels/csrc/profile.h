/* Time per phase of the step, for bench/step_profile.py: compiled in only with -DLLORCH_PROFILE,
 * otherwise every mark is nothing. The first thread reads the clock after each phase's closing
 * barrier, so a phase's time is its slowest thread's, waiting included, as the step feels it. */
#ifndef LLORCH_PROFILE_H
#define LLORCH_PROFILE_H

enum step_phase {
    PH_SETUP, PH_NORM, PH_QKV, PH_ROPE_CACHE, PH_ATTEND, PH_COMBINE, PH_O, PH_RESIDUAL, PH_GATE_UP,
    PH_ACTIVATION, PH_DOWN, PH_HEAD, PH_COUNT
};

#if defined(LLORCH_PROFILE) && defined(_OPENMP)
#include <omp.h>
extern double llorch_phase_seconds[PH_COUNT];
extern double llorch_phase_clock;
#define PROFILE_START()                                                    \
    do {                                                                   \
        if (omp_get_thread_num() == 0) llorch_phase_clock = omp_get_wtime(); \
    } while (0)
#define PROFILE(phase)                                                     \
    do {                                                                   \
        if (omp_get_thread_num() == 0) {                                   \
            const double now = omp_get_wtime();                            \
            llorch_phase_seconds[phase] += now - llorch_phase_clock;       \
            llorch_phase_clock = now;                                      \
        }                                                                  \
    } while (0)
#else
#define PROFILE_START() ((void)0)
#define PROFILE(phase) ((void)0)
#endif

#endif
