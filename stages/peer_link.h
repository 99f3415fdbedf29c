// peer_link.h: a stage server's connections to other stage servers (peer-to-peer hops).
//
// Defines swarm::PeerLink. With `--listen`, a ROUTER socket answers FETCH {key, part} from
// other peers out of the server's Holdings (FETCHED with the tensor, or ERROR not_held). For a
// request from the router that names tensors held elsewhere (wire::TensorRef), `resolve` finds
// each one in the Holdings (a tensor this peer made or fetched before) or sends FETCH to its
// holder over a DEALER socket per holder address, opened on first use and closed after a minute
// unused; once every reference arrived the request is whole (wire::resolve) and goes to the
// compute thread. A reference that does not arrive within the fetch timeout, or that its holder
// no longer has, fails the request with ERROR unreachable / not_held naming the tensor; a
// fetched tensor that is not the one referenced fails it with ERROR bad_tensor (its maker may be
// lying: the router asks for a second opinion). In a CURVE swarm (`own` keys given) both ends
// are encrypted and authenticated: the listen socket admits only the keys the router named in
// PEER_KEYS (other stage servers of the swarm), and a dialer checks that the holder is who the
// reference says (TensorRef.from_key). Pushes: on the router's PUSH a holder sends a tensor to
// a hop's receiver before it is asked (an unasked FETCHED on the receiver's listen socket); the
// receiver waits a while for a reference marked `pushed` (timing::push_wait_s, at the pace its
// holder's tensors have come at) before it fetches it, and keeps a push that came before its
// request as a copy. A reference whose
// holder sent this peer a tensor lately (timing::kHeardWithinS) but not this one within the
// window fails `unreachable` with `reached` (a busy link): its FETCH stays out, and a request
// for the same tensor that comes again waits for that answer rather than asking a second time.
// The I/O thread owns it; torch-free.
// Protocol: docs/protocol.md, "Peer to peer".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "runtime/keys.h"
#include "runtime/wire.h"
#include "runtime/messages.h"
#include "stages/holdings.h"

namespace swarm {

class PeerLink {
 public:
  // listen: "" (no connections taken: this peer is relayed) or a ZeroMQ endpoint to bind
  // (tcp://0.0.0.0:PORT, tcp://127.0.0.1:*); advertise: the address others dial ("": the bound
  // endpoint, which must then not be a wildcard address). Throws InputError saying what to fix.
  PeerLink(zmq::context_t& ctx, const std::string& listen, const std::string& advertise, Holdings& holdings,
           double fetch_timeout_s, std::optional<KeyPair> own = std::nullopt);
  ~PeerLink();
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // What HELLO says others should dial ("" when not listening).
  const std::string& address() const { return address_; }

  // The sockets to poll, appended to `items`; `ready` is called with the same items after the poll.
  void add_poll_items(std::vector<zmq::pollitem_t>& items);
  void ready(const std::vector<zmq::pollitem_t>& items, size_t first, double now);

  // A request from the router with references: resolved here, then returned by `take`.
  void resolve(wire::Message m, uint64_t seq, double now);

  struct Resolved {
    wire::Message msg;                 // the request, whole (when error is unset)
    uint64_t seq = 0;
    std::vector<int64_t> fetched;      // bytes fetched from other peers, per request tensor
    std::optional<wire::Message> error;  // else: the ERROR to send the router instead
    int64_t push_late = 0;             // pushed references fetched after all (RESULT.push_late)
    double fetch_s = 0;                // from its arrival until its last fetched or pushed reference came (RESULT.fetch_ms); 0: none, or one came before it
  };
  // Requests resolved (or failed, timeouts included) since the last call.
  std::vector<Resolved> take(double now);
  size_t waiting() const { return waiting_.size(); }

  // The answer to a FETCH (from a peer, or the router relaying): FETCHED with a share of the
  // tensor, or ERROR not_held.
  wire::Message serve(const wire::Message& fetch);

  // PUSH from the router: send that tensor to its receiver now (nothing, when not held here).
  void push(const msg::Push& p, double now);

  // PEER_KEYS from the router: the stage servers that may fetch from this one.
  void peer_keys(const msg::PeerKeys& k);
  uint64_t refused() const { return zap_ ? zap_->refused() : 0; }

  // Whether the outgoing path is cut (a partition fault): nothing served, nothing fetched.
  void set_cut(bool cut) { cut_ = cut; }

  uint64_t fetches = 0, fetch_bytes = 0, served = 0, served_bytes = 0;   // counters for the log and /metrics
  uint64_t failed = 0;                                  // requests failed because a reference did not arrive
  uint64_t pushes = 0, push_bytes = 0;                  // tensors this peer pushed to receivers (PUSH)
  uint64_t pushed_in = 0, push_late = 0;                // pushes received; pushed references fetched after all
  std::map<std::string, uint64_t> fetched_from;         // wire bytes fetched, per holder address

 private:
  struct Dialer {
    std::unique_ptr<zmq::socket_t> sock;
    double last_used = 0;
  };
  struct Waiting {
    wire::Message msg;
    uint64_t seq = 0;
    std::vector<std::optional<wire::Tensor>> got;   // per reference
    std::vector<int64_t> fetched;                   // per request tensor
    std::vector<double> push_until;                 // per reference: waiting for its push until then (0: not)
    double arrived_s = 0;   // when it came: the router sent the PUSHes of its references about then
    // When the last of its tensors that crossed a link after it came arrived; whether one had come
    // (or been asked for) before it: then that time is not its transfers' (Resolved::fetch_s).
    double came_s = 0;
    bool early = false;
    int64_t push_late = 0;
    size_t missing = 0;
    double window_s = 0;    // the wait allowed: --fetch-timeout-s, or less where the request asks
    double deadline = 0;
    std::optional<wire::Message> error;
  };
  struct Fetching {
    uint64_t request = 0;   // the waiting request (its key in waiting_); 0: its request failed (late_fetches_)
    size_t ref = 0;         // which of its references
    std::string address;
    uint64_t key = 0;       // the tensor asked for
    uint32_t part = 0;
    double sent_s = 0;
  };
  // A push given up on: when its request came, and from which holder (holder_of).
  struct GivenUp {
    double since_s = 0;
    std::string holder;
  };
  // The socket to `address` (plus " key" under CURVE) in `in`, opened on first use: a fetcher
  // (dialers_, replies read) or a pusher (pushers_, at most kPushQueue queued, never read).
  Dialer& dialer(std::map<std::string, Dialer>& in, const std::string& address, const std::string& key, double now, int sndhwm);
  void fail(Waiting& w, size_t ref, WireErrc code, const std::string& why, bool reached = false);
  // Its dialer's name: the holder's address, and under CURVE its key.
  std::string holder_of(const wire::TensorRef& r) const { return own_ ? r.from + " " + r.from_key : r.from; }
  // FETCH reference `i` of waiting request `wid` from its holder.
  void fetch(uint64_t wid, Waiting& w, size_t i, double now);
  // An unasked FETCHED on the listen socket: a holder pushing a tensor here.
  void on_push(wire::Message& m, double now);
  void on_fetch_reply(wire::Received& r, const std::string& address, double now);
  // The answer to FETCH `fid`, whose request gave up on it (late_fetches_): kept as a copy.
  void late_answer(uint64_t fid, const Fetching& fetch, wire::Received& r, double now);
  // Seconds since `holder` last sent this peer a tensor (a huge number: never).
  double heard_ago_s(const std::string& holder, double now) const;
  // `bytes` from `holder` arrived (a FETCH's answer: asked for at `since_s`; a push: its request
  // came then): heard from now, and the link's pace learned (s_per_mb_), timed from the later of
  // `since_s` and its last arrival (tensors back to back share the link).
  void arrived(const std::string& holder, uint64_t bytes, double since_s, double now);
  // Bytes of the pushes from `holder` that requests here are waiting for.
  uint64_t pushes_awaited(const std::string& holder) const;

  zmq::context_t& ctx_;
  std::optional<KeyPair> own_;
  std::mutex keys_mu_;                         // allowed_ is read by the ZAP thread
  std::set<std::string> allowed_;
  std::unique_ptr<ZapHandler> zap_;
  std::unique_ptr<zmq::socket_t> listen_;
  std::string address_;
  Holdings& holdings_;
  double fetch_timeout_s_;
  bool cut_ = false;
  std::map<std::string, Dialer> dialers_;
  // Sockets that push to receivers, apart from the fetching ones: a push to a receiver that is
  // not connected (yet, or at all) is dropped rather than queued past a few tensors.
  std::map<std::string, Dialer> pushers_;
  std::vector<std::string> polled_;            // dialer addresses in the order add_poll_items listed them
  std::map<uint64_t, Waiting> waiting_;        // by arrival number
  uint64_t next_waiting_ = 1;
  std::map<uint64_t, Fetching> fetching_;      // by FETCH id
  // Pushes that came before their request, kept as copies: their wire bytes, by (key, part), so
  // the request reports them as fetched (the oldest forgotten past kMaxEarly).
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> early_;
  // Pushes given up on and fetched instead: one that still comes is not kept (its request has
  // what it needs, and the router may have released the copy already). Bounded as early_.
  std::map<std::pair<uint64_t, uint32_t>, GivenUp> late_;
  static constexpr size_t kMaxEarly = 4096;
  // When each holder (holder_of) last sent this peer a tensor, fetched or pushed.
  std::map<std::string, double> heard_;
  // Seconds per MB that each holder's tensors of at least timing::kPaceMinBytes took to arrive here
  // (timing::ema): a push from it is waited for at that pace, where it is slower than
  // timing::push_wait_s assumes. On a slow or congested link, a push fetched again because it was
  // not there at 10 MB/s crossed the link twice, and made the router stop pushing to this peer.
  std::map<std::string, double> s_per_mb_;
  // FETCHes of a failed request still out to a holder heard from lately (fetching_ ids, by (key,
  // part)): the answer is kept as a copy, and a request for the same tensor takes the FETCH over.
  // Bounded as early_.
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> late_fetches_;
  uint64_t next_fetch_ = 1;
};

}  // namespace swarm
