/* Fault injection for the stand-in device, NCCL and the training drivers, read once from the
 * environment. Set them on the one process (rank) that should misbehave. Each acts where it happens
 * on a GPU: the slowdown and the device stop in the stand-in device (kernels), the link and stuck
 * faults in the stand-in NCCL (on the device's executor when it is asynchronous), the hang before a
 * call in the driver (the application never makes the call):
 *   RANKWATCH_STANDIN_SLOWDOWN=0.2          compute kernels take 20% longer
 *   RANKWATCH_STANDIN_SLOWDOWN_FROM_CALL=N  ... only once N NCCL operations were launched (a GPU that degrades)
 *   RANKWATCH_STANDIN_LINK_PEER=R           with RANKWATCH_STANDIN_LINK_LATENCY_US=U: every send to
 *                                           and receive from global rank R is U microseconds late
 *   RANKWATCH_STANDIN_HANG_BEFORE_CALL=N    the driver stops before its N-th NCCL call (never calls)
 *   RANKWATCH_STANDIN_HANG_WHEN_FILE=PATH   ... before its first NCCL call once PATH exists (a hang on cue:
 *                                           a test makes it after what must come first, at any pace)
 *   RANKWATCH_STANDIN_STUCK_IN_CALL=N       the N-th NCCL operation never completes: synchronous device,
 *                                           the call itself never returns; asynchronous device, the call
 *                                           returns and the operation's GPU work never starts (its stream
 *                                           stops just before it, as behind earlier work that never ends)
 *                                           while its peers start theirs and wait inside
 *   RANKWATCH_STANDIN_NEVER_ENDS_CALL=N     the N-th NCCL operation never completes: synchronous device,
 *                                           as above; asynchronous device, it starts on the GPU like its
 *                                           peers' and never ends (every member looks alike)
 *   RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL=N  the N-th compute kernel never ends and the device runs
 *                                           nothing after it (so the collectives behind it never start)
 *   RANKWATCH_STANDIN_MISMATCH_AT_CALL=N    the driver's first all-reduce with peers from its N-th call on is
 *                                           another collective than its peers' (a code path taken on this
 *                                           rank only), as RANKWATCH_STANDIN_MISMATCH says: `op` (a broadcast
 *                                           from root 0, the default), `count` (half the elements) or `dtype`
 *                                           (bfloat16 for float32, float32 otherwise); the stand-in NCCL then
 *                                           never completes it on any member, as the real library
 * Calls are counted per process, 1-based, over collectives and send/recv of every communicator.
 */
#ifndef RANKWATCH_STANDIN_FAULTS_H
#define RANKWATCH_STANDIN_FAULTS_H

#include <stdint.h>

typedef enum { RW_MISMATCH_OP, RW_MISMATCH_COUNT, RW_MISMATCH_DTYPE } rw_mismatch;

typedef struct rw_faults {
  double slowdown;
  uint64_t slowdown_from_call; /* the slowdown starts after this many NCCL calls (fail-slow onset) */
  int link_peer;
  int64_t link_latency_ns;
  uint64_t hang_before_call;
  const char* hang_when_file; /* NULL: no cue */
  uint64_t stuck_in_call;
  uint64_t never_ends_call;
  uint64_t device_stop_at_kernel;
  uint64_t mismatch_at_call;
  rw_mismatch mismatch; /* what differs in the mismatched call */
} rw_faults;

/* Parsed once; invalid values are reported on stderr and ignored. */
const rw_faults* rw_faults_get(void);

/* Sleeps forever: what a hung rank does. */
void rw_hang_forever(void) __attribute__((noreturn));

int64_t rw_now_realtime_ns(void);
int64_t rw_now_monotonic_ns(void);
void rw_sleep_ns(int64_t ns);

#endif
