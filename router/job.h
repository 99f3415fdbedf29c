// job.h: what the core gives a job (Ctx) and what a job must do (the Job interface).
//
// Defines swarm::router::Ctx, JobState and Job. A job owns its microbatches and its phases; the
// core owns the peers and the requests and calls the running job with every event that
// concerns it. Two jobs exist: TrainingJob (router/training_job.h) and EchoJob (the transport
// benchmark, router/echo_job.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "router/core.h"
#include "router/requests.h"
#include "runtime/messages.h"

namespace swarm::router {

// Why a receiver could not fetch a held tensor (ERROR unreachable or not_held, docs/protocol.md).
enum class FetchMiss {
  kUnreachable,   // no answer in the window, and the holder has sent the receiver nothing lately
  kBusyLink,      // no answer in the window from a holder that sent the receiver a tensor lately (`reached`)
  kNotHeld,       // the holder answered that it no longer has it
};

// A tensor a peer made and keeps (peer to peer): the reply to request `key` carried it as its
// part `part`.
struct Held {
  PeerId holder;
  uint64_t key = 0;
  uint32_t part = 0;
  wire::TensorDesc desc;
};

// Freed boxes of one type, kept for the next box of that type: a hop fills and empties a
// flight's slots all the time, and glibc's per-thread cache keeps only seven blocks of a size,
// so a burst of hops went through malloc's slow path. At most kKeep blocks wait per type and
// thread; the rest go back to the heap.
template <class T>
class BoxPool {
 public:
  static constexpr size_t kKeep = 4096;
  static void* get() {
    BoxPool& p = mine();
    if (p.closed_ || p.free_.empty()) return ::operator new(sizeof(T));
    void* m = p.free_.back();
    p.free_.pop_back();
    return m;
  }
  // Freed blocks waiting on this thread.
  static size_t kept() { return mine().free_.size(); }
  static void put(void* m) {
    BoxPool& p = mine();
    if (!p.closed_ && p.free_.size() < kKeep) p.free_.push_back(m);
    else ::operator delete(m);
  }

 private:
  // A box that outlives its thread's pool (a static destroyed after the thread's locals) goes
  // straight back to the heap.
  ~BoxPool() {
    for (void* m : free_) ::operator delete(m);
    free_.clear();
    closed_ = true;
  }
  static BoxPool& mine() {
    thread_local BoxPool pool;
    return pool;
  }
  std::vector<void*> free_;
  bool closed_ = false;
};

// An optional kept on the heap: as small as a pointer when empty. A flight keeps 2 x stages
// slots, most of them empty at any time; inline optionals made each slot ~340 bytes, and the
// router's hot path a walk through cache misses at thousands of flights. Its blocks come from
// BoxPool<T>.
template <class T>
class Boxed {
 public:
  Boxed() = default;
  Boxed(const Boxed& o) : p_(o.p_ ? make(*o.p_) : nullptr) {}
  Boxed(Boxed&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  ~Boxed() { reset(); }
  Boxed& operator=(const Boxed& o) {
    if (this == &o) return *this;
    if (!o.p_) reset();
    else if (p_) *p_ = *o.p_;
    else p_ = make(*o.p_);
    return *this;
  }
  Boxed& operator=(Boxed&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  Boxed& operator=(T v) {
    if (p_) *p_ = std::move(v);
    else p_ = make(std::move(v));
    return *this;
  }
  bool has_value() const { return p_ != nullptr; }
  explicit operator bool() const { return p_ != nullptr; }
  T& operator*() { return *p_; }
  const T& operator*() const { return *p_; }
  T* operator->() { return p_; }
  const T* operator->() const { return p_; }
  void reset() {
    if (!p_) return;
    p_->~T();
    BoxPool<T>::put(p_);
    p_ = nullptr;
  }

 private:
  template <class U>
  static T* make(U&& v) {
    void* m = BoxPool<T>::get();
    try {
      return new (m) T(std::forward<U>(v));
    } catch (...) {
      BoxPool<T>::put(m);
      throw;
    }
  }
  T* p_ = nullptr;
};

// A tensor a job needs: its bytes (kept by the router), or where they are held; neither: not
// made yet (or lost with its holder). Filled with set(), emptied with clear() (Ctx::drop also
// releases what a live holder keeps for it): the two boxes never both hold, and the wire bytes
// kept beside them always describe what they hold.
class Slot {
 public:
  bool known() const { return bytes_.has_value() || held_.has_value(); }
  const wire::TensorDesc& desc() const { return bytes_ ? bytes_->desc : held_->desc; }
  // Its bytes when the router keeps them, else null.
  wire::Tensor* tensor() { return bytes_ ? &*bytes_ : nullptr; }
  const wire::Tensor* tensor() const { return bytes_ ? &*bytes_ : nullptr; }
  // Where a peer keeps it, else null.
  const Held* held() const { return held_ ? &*held_ : nullptr; }
  // desc().wire_bytes(), kept beside the boxes: a result's byte accounting reads it without a
  // cache miss on the box. 0 when empty.
  uint64_t wire_bytes() const { return wire_bytes_; }
  void set(wire::Tensor t) {
    wire_bytes_ = t.desc.wire_bytes();
    held_.reset();
    bytes_ = std::move(t);
  }
  void set(Held h) {
    wire_bytes_ = h.desc.wire_bytes();
    bytes_.reset();
    held_ = std::move(h);
  }
  void clear() {
    bytes_.reset();
    held_.reset();
    wire_bytes_ = 0;
  }

 private:
  Boxed<wire::Tensor> bytes_;
  Boxed<Held> held_;
  uint64_t wire_bytes_ = 0;
};

// Everything a job may touch while it handles one event.
struct Ctx {
  double now = 0;
  const CoreOptions& opt;
  Registry& peers;
  Requests& requests;
  Actions& out;
  std::vector<PeerId>& releasing;   // holders with keys to RELEASE (Peer::to_release), sent at a tick
  Events& events;                                     // the timeline (router/events.h)

  void send(const PeerId& to, wire::Message m) { out.push_back(Send{to, std::move(m)}); }
  void log(LogLevel level, std::string text) { out.push_back(Log{level, std::move(text), 0, {}}); }
  void info(std::string text) { log(LogLevel::kInfo, std::move(text)); }
  // The tensors a peer holds for request `key` are no longer needed.
  void release(const PeerId& holder, uint64_t key) {
    if (Peer* p = peers.find(holder)) release(*p, key);
  }
  void release(Peer& holder, uint64_t key) {
    if (holder.to_release.empty()) releasing.push_back(holder.id);
    holder.to_release.push_back(int64_t(key));
  }
  // Request tensor `index` of `m`: a share of its bytes, or a reference the receiver fetches
  // from its holder's listen address.
  void attach(wire::Message& m, Slot& s, uint32_t index) const;
  // Forgets a slot, releasing what a live holder keeps for it.
  void drop(Slot& s);
  // Tensor `index` of a reply: its bytes (compressed once, to be shared), or, when the reply
  // holds it, a reference to the replier's copy. Throws InputError for a reference that is not
  // the replier's own part `index` of request `pd_id`.
  static Slot take_reply_tensor(const PeerId& from, uint64_t pd_id, wire::Message& m, size_t index);
  void warn(std::string text) { log(LogLevel::kWarn, std::move(text)); }
  // Something for the timeline: recorded as an event and logged at `level` (kDebug: recorded
  // only, for events too frequent to log, such as re-sent hops, when SWARM_LOG hides debug).
  void event(EventKind kind, LogLevel level, std::string text, uint64_t job = 0, const Peer* peer = nullptr, int stage = -1);
  // Registers `p` as pending (sent now, with its deadline) and sends `m` with its id; adds the
  // request's units to the peer's queue. Returns the id.
  uint64_t request(Pending p, wire::Message m);
  // Removes a pending request and takes its units off its peer's queue.
  std::optional<Pending> take(uint64_t id);
  // The deadline of a request other than a hop: timing::deadline_s of a few units of work behind
  // the peer's queue at its measured speed, capped by `cap_s`; 10 s when it is not measured.
  double deadline_for(const Peer& p, double cap_s) const;
};

enum class JobState { kQueued, kLoading, kRunning, kDone, kFailed, kCancelled };
const char* job_state_name(JobState s);
inline bool job_finished(JobState s) { return s == JobState::kDone || s == JobState::kFailed || s == JobState::kCancelled; }

class Job {
 public:
  Job(uint64_t id, std::string name) : id_(id), name_(std::move(name)) {}
  virtual ~Job() = default;
  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  JobState state() const { return state_; }
  const std::string& reason() const { return reason_; }
  bool active() const { return state_ == JobState::kLoading || state_ == JobState::kRunning; }

  // Whether this job uses the peer at all (echo peers serve only transport benchmarks).
  virtual bool wants(const Peer& p) const = 0;
  // The job becomes the running one: assign every registered peer it wants.
  virtual void start(Ctx& c) = 0;
  // A peer said HELLO while the job runs, or was left idle and may be offered the job again.
  virtual void offer(Ctx& c, Peer& p) = 0;
  // A peer is gone; its requests have already failed through on_failed.
  virtual void on_peer_gone(Ctx& c, const Peer& p) = 0;
  // A reply to one of the job's requests, from the peer it was sent to; `pd` already left the
  // table. Throws InputError when the reply's body or tensors are malformed: the core then
  // counts it and calls on_failed for the same request.
  virtual void on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) = 0;
  // A request failed: its peer died, answered ERROR (`error`), passed its deadline, or sent a
  // malformed reply. `bad_tensor`: the request tensor the peer reported as bad (its producer is
  // to blame), -1 for none.
  virtual void on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) = 0;
  // The peer could not fetch request tensor `slot` from the peer holding it (ERROR unreachable,
  // or not_held when the holder no longer has it).
  virtual void on_fetch_failed(Ctx& c, const Pending& pd, int slot, FetchMiss miss, const std::string& why) {
    on_failed(c, pd, false, -1, why);
  }
  // Moves the job forward (called after every event).
  virtual void advance(Ctx& c) = 0;
  virtual void on_checkpoint_written(Ctx& c, const CheckpointWritten& r) {}
  // A peer sent something corrupt, misshapen or non-finite, or made what others rejected.
  virtual void integrity_failure(Ctx& c, const PeerId& peer, const std::string& what) {}
  // SWARM_CHECKs the job's invariants against the pending requests.
  virtual void check(const Requests& r) const {}
  // Counts a RESULT to request `request` that answered no pending request (late, or a duplicate).
  virtual void duplicate(uint64_t request) {}
  // One of its requests passed its deadline (counted in the status).
  virtual void timed_out() {}
  virtual nlohmann::json status(const Registry& peers, double now) const = 0;
  // What /metrics shows of the job (router/metrics.h); the base fills id, name and state.
  virtual void metrics(JobMetrics& m, const Registry& peers, double now) const;
  // Ends the job: state, reason; its requests are dropped by the core.
  virtual void finish(Ctx& c, JobState st, const std::string& reason);
  // The job's state record in the state dir ("" without one).
  virtual void persist(Ctx& c) {}

 protected:
  uint64_t id_;
  std::string name_;
  JobState state_ = JobState::kQueued;
  std::string reason_;
  double started_s_ = 0, run_started_s_ = 0, finished_s_ = 0;
};

}  // namespace swarm::router
