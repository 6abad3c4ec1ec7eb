/* Realtime nanoseconds for the hot path, cheaper than clock_gettime.
 *
 * On x86 with an invariant TSC, time = anchor.ns + (rdtsc - anchor.tsc) * mult / 2^32, where the
 * anchor is re-taken from CLOCK_REALTIME every ~100 ms (one clock_gettime per 100 ms, not two per
 * call) and mult is re-measured over that interval, so the result follows NTP adjustments with
 * microsecond error. Elsewhere (or with RANKWATCH_CLOCK=gettime) it is clock_gettime itself.
 */
#ifndef RANKWATCH_CLOCK_H
#define RANKWATCH_CLOCK_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

typedef struct {
  uint64_t tsc;
  int64_t ns;
  uint64_t mult;           /* ns per tick, fixed point 32.32 */
  uint64_t reanchor_ticks; /* re-anchor after this many ticks */
} rw_clock_anchor;

/* Two anchors, flipped by the re-anchoring thread: a reader never sees one half-written, because the
 * slot it reads is rewritten only two re-anchors (~200 ms) later. */
extern int rw_clock_use_tsc;
extern _Atomic uint64_t rw_clock_current;
extern rw_clock_anchor rw_clock_anchors[2];

void rw_clock_init(void);
void rw_clock_reanchor(void);

static inline int64_t rw_gettime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t rw_now_ns(void) {
#if defined(__x86_64__)
  if (rw_clock_use_tsc) {
    const rw_clock_anchor* anchor =
        &rw_clock_anchors[atomic_load_explicit(&rw_clock_current, memory_order_acquire) & 1];
    uint64_t delta = __rdtsc() - anchor->tsc;
    if (__builtin_expect(delta > anchor->reanchor_ticks, 0)) rw_clock_reanchor(); /* ~every 100 ms */
    return anchor->ns + (int64_t)(((unsigned __int128)delta * anchor->mult) >> 32);
  }
#endif
  return rw_gettime_ns();
}

#endif
