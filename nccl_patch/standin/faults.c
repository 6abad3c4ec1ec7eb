#include "faults.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static rw_faults faults = {0.0, 0, -1, 0, 0, NULL, 0, 0, 0, 0, RW_MISMATCH_OP};
static pthread_once_t faults_once = PTHREAD_ONCE_INIT;

static int parse_u64(const char* name, uint64_t* out) {
  const char* text = getenv(name);
  if (!text || !*text) return 0;
  char* end;
  errno = 0;
  unsigned long long value = strtoull(text, &end, 10);
  if (errno || *end) {
    fprintf(stderr, "rankwatch stand-in: ignoring %s=%s (not a non-negative integer)\n", name, text);
    return 0;
  }
  *out = value;
  return 1;
}

static void load(void) {
  const char* slowdown = getenv("RANKWATCH_STANDIN_SLOWDOWN");
  if (slowdown && *slowdown) {
    char* end;
    double value = strtod(slowdown, &end);
    if (*end || value < 0 || value > 100)
      fprintf(stderr, "rankwatch stand-in: ignoring RANKWATCH_STANDIN_SLOWDOWN=%s (want 0..100)\n", slowdown);
    else
      faults.slowdown = value;
  }
  uint64_t value;
  parse_u64("RANKWATCH_STANDIN_SLOWDOWN_FROM_CALL", &faults.slowdown_from_call);
  if (parse_u64("RANKWATCH_STANDIN_LINK_PEER", &value)) faults.link_peer = (int)value;
  if (parse_u64("RANKWATCH_STANDIN_LINK_LATENCY_US", &value)) faults.link_latency_ns = (int64_t)value * 1000;
  parse_u64("RANKWATCH_STANDIN_HANG_BEFORE_CALL", &faults.hang_before_call);
  const char* cue = getenv("RANKWATCH_STANDIN_HANG_WHEN_FILE");
  if (cue && *cue) faults.hang_when_file = cue;
  parse_u64("RANKWATCH_STANDIN_STUCK_IN_CALL", &faults.stuck_in_call);
  parse_u64("RANKWATCH_STANDIN_NEVER_ENDS_CALL", &faults.never_ends_call);
  parse_u64("RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL", &faults.device_stop_at_kernel);
  parse_u64("RANKWATCH_STANDIN_MISMATCH_AT_CALL", &faults.mismatch_at_call);
  const char* mismatch = getenv("RANKWATCH_STANDIN_MISMATCH");
  if (mismatch && *mismatch) {
    if (strcmp(mismatch, "op") == 0)
      faults.mismatch = RW_MISMATCH_OP;
    else if (strcmp(mismatch, "count") == 0)
      faults.mismatch = RW_MISMATCH_COUNT;
    else if (strcmp(mismatch, "dtype") == 0)
      faults.mismatch = RW_MISMATCH_DTYPE;
    else
      fprintf(stderr, "rankwatch stand-in: ignoring RANKWATCH_STANDIN_MISMATCH=%s (want op, count or dtype)\n",
              mismatch);
  }
}

const rw_faults* rw_faults_get(void) {
  pthread_once(&faults_once, load);
  return &faults;
}

void rw_hang_forever(void) {
  for (;;) sleep(3600);
}

static int64_t now(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t rw_now_realtime_ns(void) { return now(CLOCK_REALTIME); }
int64_t rw_now_monotonic_ns(void) { return now(CLOCK_MONOTONIC); }

void rw_sleep_ns(int64_t ns) {
  if (ns <= 0) return;
  struct timespec ts = {ns / 1000000000, ns % 1000000000};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}
