// timing.h: the project's one backoff, one deadline formula, one heartbeat rule and one
// throughput average.
//
// Every retry (a hop re-sent, a banned peer, an unresponsive peer, a stage server reconnecting)
// waits backoff_s; every request the router sends has a deadline from deadline_s; every
// measured "ms per work unit" (the router's view of a peer, and the peer's own) is the same EMA.
// Durations in seconds unless the name says otherwise.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace swarm::timing {

// base_s * 2^(n-1), at most cap_s: the wait after the n-th failure in a row (n >= 1).
inline double backoff_s(double base_s, double cap_s, int n) {
  return std::min(cap_s, base_s * std::ldexp(1.0, std::max(0, std::min(n, 60) - 1)));
}

// A request's deadline: four times what it should take (the peer's queue and this work at its
// measured speed) plus 1 s, at least 2 s, at most cap_s (the job's timeouts).
inline double deadline_s(double expect_s, double cap_s) {
  return std::min(cap_s, std::max(2.0, 4.0 * expect_s + 1.0));
}

// The slowest link a deadline allows for without being told: 100 Mbit/s, a home uplink.
constexpr double kSlowLinkBytesPerS = 12.5e6;

// The least bytes a transfer must carry to time a link's pace (seconds per MB: PeerLink's per
// holder, the router's per peer): under it, the time is the link's latency more than its rate.
constexpr uint64_t kPaceMinBytes = 64 << 10;

// What a deadline adds for `bytes` that must cross a link (a request's inputs, a reply's stage
// state): four times their transfer at kSlowLinkBytesPerS, or at `s_per_mb` where the receiver's
// transfers have been slower (RESULT.fetch_ms). Never capped by the job's timeouts, which bound
// compute: a gigabyte on a slow link is slow, not dead.
inline double transfer_allowance_s(double bytes, double s_per_mb = 0) {
  return 4.0 * bytes * std::max(1.0 / kSlowLinkBytesPerS, s_per_mb / 1e6);
}

// How long a receiver waits for the tensors a request references before it answers
// `unreachable`: three quarters of the time to the request's deadline (the last quarter, at least
// half a second of a 2-s deadline, is for the work and the reply), at least 1 ms. The router then
// hears of an unreachable holder in time to relay the tensor on the next attempt.
constexpr uint32_t kMaxFetchWithinMs = 3600 * 1000;   // at most an hour
inline uint32_t fetch_within_ms(double until_deadline_s) {
  return uint32_t(std::clamp(0.75 * until_deadline_s * 1000.0, 1.0, double(kMaxFetchWithinMs)));
}
inline double fetch_window_of(double until_deadline_s) { return fetch_within_ms(until_deadline_s) / 1000.0; }

// A receiver whose holder sent it a tensor (a fetch's answer, a push) within this long, and who
// then waits out a fetch's window from that holder, reports the holder as reached
// (msg::Error::reached): a busy link, not a cut one, which the router answers by sending the hop
// again before it relays anything. A holder silent this long is unreachable from the receiver.
constexpr double kHeardWithinS = 10;

// How long a receiver waits for a request's references: its own timeout, or less where the
// request asks (fetch_within_ms; 0: not asked).
inline double fetch_window_s(double own_timeout_s, uint32_t within_ms) {
  return within_ms ? std::min(own_timeout_s, within_ms / 1000.0) : own_timeout_s;
}

// How long a receiver waits for a pushed reference of `bytes` before it fetches it (PUSH: its
// holder sent it when the router sent the request, so it is due about when the request is): a
// second plus its bytes at 10 MB/s, or at `s_per_mb` where that is slower (the pace its holder's
// tensors have come at), within half the request's window.
inline double push_wait_s(uint64_t bytes, double window_s, double s_per_mb = 0) {
  return std::min(window_s / 2, 1.0 + double(bytes) / 1e6 * std::max(0.1, s_per_mb));
}

// When a stage server's next heartbeat is due (seconds on its own clock), from when it sent the
// last one and when it last sent the router anything (the heartbeat included). The router counts
// any message as a sign of life, so a peer that sent it something within the last beat (a busy
// peer's results) skips its heartbeat, except every kBusyBeatEvery-th beat, which keeps the
// counters it carries fresh: the longest silence the router sees is then a beat (and the turn
// of the peer's loop). Where the router's window is under 3 beats (`liveness`) every beat goes
// out, as the router's own rule for its heartbeats has it.
constexpr int kBusyBeatEvery = 4;
inline double next_heartbeat_s(double last_beat_s, double last_sent_s, double beat_s, int liveness) {
  if (liveness < 3) return last_beat_s + beat_s;
  return std::max(last_beat_s + beat_s, std::min(last_sent_s + beat_s, last_beat_s + kBusyBeatEvery * beat_s));
}

// The exponential moving average of a peer's ms per work unit: weight 0.1 on each new sample
// (SWARM's choice: a few slow hops do not swing routing), the first sample taken as it is.
constexpr double kEmaWeight = 0.1;
inline double ema(double average, double sample) {
  return average <= 0 ? sample : (1 - kEmaWeight) * average + kEmaWeight * sample;
}

}  // namespace swarm::timing
