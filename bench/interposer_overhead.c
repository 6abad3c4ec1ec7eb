/* Cost the interposer adds to one NCCL call, measured against the stand-in called directly in the
 * same process: ncclAllReduce goes through librankwatch-nccl.so (LD_PRELOAD), pncclAllReduce is the
 * stand-in's own strong symbol. One rank, so the collective itself is a few shared-memory atomics.
 * Prints p50/p99 of each and the difference. Batches alternate so drift hits both equally; a pause
 * between batches lets the GPU-timing poller drain its event pool as a training step would.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>

#include "../nccl_patch/include/nccl_abi.h"

/* Allocation and lock counters: this executable's malloc and pthread_mutex_lock come first in symbol
 * lookup, so every library's calls (the interposer's included) pass through them. */
static _Atomic long allocations, locks;
extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
void* malloc(size_t n) { allocations++; return __libc_malloc(n); }
void* calloc(size_t n, size_t m) { allocations++; return __libc_calloc(n, m); }
void* realloc(void* p, size_t n) { allocations++; return __libc_realloc(p, n); }
int pthread_mutex_lock(pthread_mutex_t* mutex) {
  static int (*real)(pthread_mutex_t*);
  if (!real) real = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  locks++;
  return real(mutex);
}

#define BATCH 1000
#define BATCHES 200

static int compare(const void* a, const void* b) {
  uint64_t x = *(const uint64_t*)a, y = *(const uint64_t*)b;
  return x < y ? -1 : x > y;
}

static double ns_per_tick;

static void calibrate(void) {
  struct timespec a, b, pause = {0, 50000000};
  clock_gettime(CLOCK_MONOTONIC, &a);
  uint64_t t0 = __rdtsc();
  nanosleep(&pause, NULL);
  uint64_t t1 = __rdtsc();
  clock_gettime(CLOCK_MONOTONIC, &b);
  ns_per_tick = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (double)(t1 - t0);
}

int main(void) {
  ncclUniqueId id;
  ncclComm_t comm;
  if (ncclGetUniqueId(&id) || ncclCommInitRank(&comm, 1, id, 0)) return 2;
  float value = 1.0f;
  uint64_t* traced = malloc(sizeof(uint64_t) * BATCH * BATCHES);
  uint64_t* direct = malloc(sizeof(uint64_t) * BATCH * BATCHES);
  calibrate();
  struct timespec pause = {0, 3000000};
  for (int warm = 0; warm < 10000; warm++) ncclAllReduce(&value, &value, 1, ncclFloat32, ncclSum, comm, NULL);
  long allocations_before = allocations, locks_before = locks;
  for (int batch = 0; batch < BATCHES; batch++) {
    for (int i = 0; i < BATCH; i++) {
      uint64_t t0 = __rdtsc();
      pncclAllReduce(&value, &value, 1, ncclFloat32, ncclSum, comm, NULL);
      direct[batch * BATCH + i] = __rdtsc() - t0;
    }
    for (int i = 0; i < BATCH; i++) {
      uint64_t t0 = __rdtsc();
      ncclAllReduce(&value, &value, 1, ncclFloat32, ncclSum, comm, NULL);
      traced[batch * BATCH + i] = __rdtsc() - t0;
    }
    nanosleep(&pause, NULL);
  }
  long hot_allocations = allocations - allocations_before, hot_locks = locks - locks_before;
  size_t n = (size_t)BATCH * BATCHES;
  qsort(traced, n, sizeof(uint64_t), compare);
  qsort(direct, n, sizeof(uint64_t), compare);
  double d50 = direct[n / 2] * ns_per_tick, d99 = direct[n * 99 / 100] * ns_per_tick;
  double t50 = traced[n / 2] * ns_per_tick, t99 = traced[n * 99 / 100] * ns_per_tick;
  printf("{\"calls\": %zu, \"direct_p50_ns\": %.1f, \"direct_p99_ns\": %.1f, \"traced_p50_ns\": %.1f, "
         "\"traced_p99_ns\": %.1f, \"added_p50_ns\": %.1f, \"added_p99_ns\": %.1f, \"allocations\": %ld, "
         "\"mutex_locks\": %ld}\n",
         n, d50, d99, t50, t99, t50 - d50, t99 - d99, hot_allocations, hot_locks);
  ncclCommDestroy(comm);
  return 0;
}
