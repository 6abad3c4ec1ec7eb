#define _GNU_SOURCE
#include "clock.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rw_clock_use_tsc;
_Atomic uint64_t rw_clock_current;
rw_clock_anchor rw_clock_anchors[2];
static _Atomic int reanchoring;

#if defined(__x86_64__)
static int invariant_tsc(void) {
  FILE* cpuinfo = fopen("/proc/cpuinfo", "r");
  if (!cpuinfo) return 0;
  char line[4096];
  int constant = 0, nonstop = 0;
  while (fgets(line, sizeof line, cpuinfo)) {
    if (strncmp(line, "flags", 5) != 0) continue;
    constant = strstr(line, " constant_tsc") != NULL;
    nonstop = strstr(line, " nonstop_tsc") != NULL;
    break;
  }
  fclose(cpuinfo);
  return constant && nonstop;
}

static void sample(uint64_t* tsc, int64_t* ns) {
  /* the clock read bracketed by two TSC reads; take the midpoint */
  uint64_t before = __rdtsc();
  *ns = rw_gettime_ns();
  uint64_t after = __rdtsc();
  *tsc = before + (after - before) / 2;
}
#endif

static uint64_t ticks_for(uint64_t ns, uint64_t mult) { return (uint64_t)(((unsigned __int128)ns << 32) / mult); }

void rw_clock_reanchor(void) {
#if defined(__x86_64__)
  int idle = 0;
  if (!atomic_compare_exchange_strong(&reanchoring, &idle, 1)) return; /* another thread is at it */
  uint64_t current = atomic_load_explicit(&rw_clock_current, memory_order_relaxed);
  rw_clock_anchor old = rw_clock_anchors[current & 1];
  uint64_t tsc;
  int64_t ns;
  sample(&tsc, &ns);
  rw_clock_anchor next = {tsc, ns, old.mult, old.reanchor_ticks};
  if (tsc > old.tsc && ns > old.ns) { /* re-measure the rate; a stepped-back clock keeps the old one */
    next.mult = (uint64_t)(((unsigned __int128)(ns - old.ns) << 32) / (tsc - old.tsc));
    next.reanchor_ticks = ticks_for(100000000, next.mult);
  }
  rw_clock_anchors[(current + 1) & 1] = next;
  atomic_store_explicit(&rw_clock_current, current + 1, memory_order_release);
  atomic_store_explicit(&reanchoring, 0, memory_order_release);
#endif
}

void rw_clock_init(void) {
#if defined(__x86_64__)
  const char* choice = getenv("RANKWATCH_CLOCK");
  if ((choice && strcmp(choice, "gettime") == 0) || !invariant_tsc()) return;
  uint64_t tsc0, tsc1;
  int64_t ns0, ns1;
  sample(&tsc0, &ns0);
  struct timespec pause = {0, 2000000};
  nanosleep(&pause, NULL);
  sample(&tsc1, &ns1);
  if (tsc1 <= tsc0 || ns1 <= ns0) return;
  uint64_t mult = (uint64_t)(((unsigned __int128)(ns1 - ns0) << 32) / (tsc1 - tsc0));
  /* the first interval is short; re-anchor soon so the rate is re-measured over a longer one */
  rw_clock_anchors[0] = (rw_clock_anchor){tsc1, ns1, mult, ticks_for(10000000, mult)};
  atomic_store(&rw_clock_current, 0);
  rw_clock_use_tsc = 1;
#endif
}
