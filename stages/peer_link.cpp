// peer_link.cpp: implements stages/peer_link.h.
#include "stages/peer_link.h"

#include <cmath>

#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/messages.h"
#include "runtime/text.h"
#include "runtime/timing.h"

namespace swarm {

namespace {

constexpr double kDialerIdleS = 60;
constexpr int kPushQueue = 8;        // pushes queued to one receiver at most
constexpr int kFetchQueue = 100000;  // FETCHes queued to one holder (socket_of's high-water mark)

std::unique_ptr<zmq::socket_t> socket_of(zmq::context_t& ctx, zmq::socket_type type) {
  auto s = std::make_unique<zmq::socket_t>(ctx, type);
  s->set(zmq::sockopt::linger, 0);
  s->set(zmq::sockopt::sndhwm, 100000);
  s->set(zmq::sockopt::rcvhwm, 100000);
  return s;
}

// What a received message took on the wire: its frames' bytes.
uint64_t frames_bytes(const wire::Received& r) {
  uint64_t n = 0;
  for (const zmq::message_t& f : r.frames) n += f.size();
  return n;
}

}  // namespace

PeerLink::PeerLink(zmq::context_t& ctx, const std::string& listen, const std::string& advertise, Holdings& holdings,
                   double fetch_timeout_s, std::optional<KeyPair> own)
    : ctx_(ctx), own_(std::move(own)), holdings_(holdings), fetch_timeout_s_(fetch_timeout_s) {
  if (listen.empty()) {
    if (!advertise.empty()) throw InputError("--advertise needs --listen: the address to bind and take connections on");
    return;
  }
  if (own_) {
    zap_ = std::make_unique<ZapHandler>(ctx, [this](const std::string& key, const std::string&) -> std::optional<Identity> {
      std::lock_guard<std::mutex> l(keys_mu_);
      if (!allowed_.count(key)) return std::nullopt;
      return Identity{true, key, "", Role::kStage};
    });
  }
  listen_ = socket_of(ctx, zmq::socket_type::router);
  if (own_) curve_server(*listen_, *own_, "swarm-peers");
  // A FETCH is small and a push one tensor; a peer that sends frames over that is cut off by
  // libzmq before buffering them.
  listen_->set(zmq::sockopt::maxmsgsize, int64_t(limits::kMaxTensorBytes) + int64_t(limits::kMaxSmallBodyBytes));
  try {
    listen_->bind(listen);
  } catch (const zmq::error_t& e) {
    throw InputError("--listen " + listen + ": cannot bind (" + e.what() + "); give a free port, e.g. tcp://0.0.0.0:6000");
  }
  address_ = advertise.empty() ? listen_->get(zmq::sockopt::last_endpoint) : advertise;
  if (address_.rfind("tcp://0.0.0.0:", 0) == 0 || address_.rfind("tcp://[::]:", 0) == 0 || address_.rfind("tcp://*:", 0) == 0)
    throw InputError("--listen " + listen + " binds every interface, so other peers need to be told which address reaches this "
                     "one: add --advertise tcp://HOST:PORT (HOST: this machine's address as the other hosts see it)");
  if (address_.size() > wire::kMaxAddressBytes) throw InputError("--advertise: longer than " + std::to_string(wire::kMaxAddressBytes) + " bytes");
}

PeerLink::~PeerLink() = default;

void PeerLink::add_poll_items(std::vector<zmq::pollitem_t>& items) {
  if (listen_) items.push_back({listen_->handle(), 0, ZMQ_POLLIN, 0});
  polled_.clear();
  for (auto& [address, d] : dialers_) {
    items.push_back({d.sock->handle(), 0, ZMQ_POLLIN, 0});
    polled_.push_back(address);
  }
}

void PeerLink::ready(const std::vector<zmq::pollitem_t>& items, size_t first, double now) {
  size_t i = first;
  if (listen_) {
    if (items[i].revents & ZMQ_POLLIN) {
      for (int n = 0; n < 256; ++n) {
        auto r = wire::recv_frames(*listen_, true, zmq::recv_flags::dontwait);
        if (!r) break;
        if (cut_) continue;  // partitioned: the request never arrived
        wire::Message reply;
        try {
          wire::Message m = wire::decode(r->frames);
          if (m.type == wire::MsgType::kFetched && m.id == 0) {
            on_push(m, now);   // a notice: nothing goes back
            continue;
          }
          if (m.type != wire::MsgType::kFetch)
            throw WireError(WireErrc::kOutOfOrder, std::string("a peer's listen socket takes FETCH and pushed FETCHED, not ") + wire::msg_type_name(m.type));
          reply = serve(m);
        } catch (const InputError& e) {
          const std::optional<uint64_t> id = wire::peek_id(r->frames);
          reply = msg::error_reply(id.value_or(0), 0, WireErrc::kMalformed, e.what());
        }
        wire::send(*listen_, reply, &r->route);
      }
    }
    ++i;
  }
  for (const std::string& address : polled_) {
    auto it = dialers_.find(address);
    const bool in = items[i++].revents & ZMQ_POLLIN;
    if (it == dialers_.end() || !in) continue;
    for (int n = 0; n < 256; ++n) {
      auto r = wire::recv_frames(*it->second.sock, false, zmq::recv_flags::dontwait);
      if (!r) break;
      it->second.last_used = now;
      on_fetch_reply(*r, address, now);
    }
  }
  // Dialers nobody used for a while are closed (their holders may be long gone).
  for (auto it = dialers_.begin(); it != dialers_.end();) {
    bool busy = false;
    for (const auto& [id, f] : fetching_) busy |= f.address == it->first;
    if (!busy && now - it->second.last_used > kDialerIdleS) it = dialers_.erase(it);
    else ++it;
  }
  for (auto it = pushers_.begin(); it != pushers_.end();) it = now - it->second.last_used > kDialerIdleS ? pushers_.erase(it) : std::next(it);
  for (auto it = heard_.begin(); it != heard_.end();) it = now - it->second > timing::kHeardWithinS ? heard_.erase(it) : std::next(it);
}

wire::Message PeerLink::serve(const wire::Message& fetch) {
  const msg::Fetch f = msg::read<msg::Fetch>(fetch);
  std::optional<wire::Tensor> t = holdings_.get(f.key, uint32_t(f.part));
  if (!t)
    return msg::error_reply(&fetch, WireErrc::kNotHeld,
                            "this peer does not hold part " + std::to_string(f.part) + " of request " + std::to_string(f.key) +
                                " (released, expired or never made)");
  wire::Message reply = msg::make(wire::MsgType::kFetched, f, fetch.id, fetch.attempt);
  served++;
  served_bytes += t->desc.wire_bytes();
  reply.tensors.push_back(std::move(*t));
  return reply;
}

void PeerLink::push(const msg::Push& p, double now) {
  if (cut_) return;  // partitioned: the receiver fetches, and fails, as it would
  std::optional<wire::Tensor> t = holdings_.get(p.key, uint32_t(p.part));
  if (!t) return;   // released or evicted: the receiver's FETCH hears not_held
  msg::Fetch f;
  f.key = p.key;
  f.part = p.part;
  wire::Message m = msg::make(wire::MsgType::kFetched, f, 0);
  const uint64_t bytes = t->desc.wire_bytes();
  m.tensors.push_back(std::move(*t));
  if (own_ && !valid_z85_key(p.to_key)) return;
  const std::string to = own_ ? p.to + " " + p.to_key : p.to;
  Dialer& d = dialer(pushers_, to, p.to_key, now, kPushQueue);
  std::vector<zmq::message_t> frames = wire::encode(m);
  for (size_t i = 0; i < frames.size(); ++i) {
    // Never blocks: with the queue full (the receiver unreachable, or slow) the push is dropped
    // and the receiver fetches. A message's first frame taken, the rest are.
    const auto more = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    if (!d.sock->send(frames[i], more | zmq::send_flags::dontwait)) return;
  }
  pushes++;
  push_bytes += bytes;
}

void PeerLink::on_push(wire::Message& m, double now) {
  if (m.tensors.size() != 1) return;
  const msg::Fetch f = msg::read<msg::Fetch>(m);
  wire::Tensor& t = m.tensors[0];
  pushed_in++;
  // The requests waiting for it take it; one that came first is kept as a copy for its request.
  bool used = false;
  for (auto& [wid, w] : waiting_) {
    for (size_t i = 0; i < w.msg.refs.size(); ++i) {
      const wire::TensorRef& r = w.msg.refs[i];
      if (w.got[i] || r.key != f.key || r.part != uint32_t(f.part) || !wire::same_tensor(t.desc, r.desc)) continue;
      wire::Tensor mine = wire::share(t);
      wire::decompress(mine);
      w.got[i] = std::move(mine);
      w.fetched[r.slot] += int64_t(t.desc.wire_bytes());
      w.missing--;
      w.came_s = now;
      arrived(holder_of(r), t.desc.wire_bytes(), w.arrived_s, now);
      used = true;
    }
  }
  bool given_up = false;
  if (auto g = late_.find({f.key, uint32_t(f.part)}); g != late_.end()) {
    // Its request fetched it instead: the push came, at the pace of this link.
    if (!used) arrived(g->second.holder, t.desc.wire_bytes(), g->second.since_s, now);
    late_.erase(g);
    given_up = true;
  }
  if (used || given_up) return;
  early_[{f.key, uint32_t(f.part)}] = t.desc.wire_bytes();
  if (early_.size() > kMaxEarly) early_.erase(early_.begin());
  holdings_.put(f.key, uint32_t(f.part), std::move(t), true, now);
}

void PeerLink::peer_keys(const msg::PeerKeys& k) {
  std::lock_guard<std::mutex> l(keys_mu_);
  for (const std::string& key : k.add) allowed_.insert(key);
  for (const std::string& key : k.remove) allowed_.erase(key);
}

PeerLink::Dialer& PeerLink::dialer(std::map<std::string, Dialer>& in, const std::string& holder, const std::string& key, double now,
                                    int sndhwm) {
  Dialer& d = in[holder];
  if (!d.sock) {
    const std::string address = holder.substr(0, holder.find(' '));
    d.sock = socket_of(ctx_, zmq::socket_type::dealer);
    d.sock->set(zmq::sockopt::sndhwm, sndhwm);
    if (own_) curve_client(*d.sock, *own_, key);
    d.sock->set(zmq::sockopt::maxmsgsize, int64_t(limits::kMaxTensorBytes) + int64_t(limits::kMaxSmallBodyBytes));
    d.sock->connect(address);
  }
  d.last_used = now;
  return d;
}

void PeerLink::resolve(wire::Message m, uint64_t seq, double now) {
  const uint64_t wid = next_waiting_++;
  Waiting& w = waiting_[wid];
  w.seq = seq;
  w.msg = std::move(m);
  w.window_s = timing::fetch_window_s(fetch_timeout_s_, w.msg.fetch_within_ms);
  w.deadline = now + w.window_s;
  w.arrived_s = now;
  w.got.resize(w.msg.refs.size());
  w.fetched.assign(w.msg.tensors.size() + w.msg.refs.size(), 0);
  w.push_until.assign(w.msg.refs.size(), 0);
  w.missing = w.msg.refs.size();
  for (size_t i = 0; i < w.msg.refs.size(); ++i) {
    const wire::TensorRef& r = w.msg.refs[i];
    if (std::optional<wire::Tensor> t = holdings_.get(r.key, r.part); t && wire::same_tensor(t->desc, r.desc)) {
      wire::decompress(*t);  // kept packed as it travels (entropy=zstd); used here as the codec's bytes
      w.got[i] = std::move(t);  // made, fetched or pushed here before
      if (auto e = early_.find({r.key, r.part}); e != early_.end()) {
        w.fetched[r.slot] += int64_t(e->second);   // pushed (or a late fetch's answer) before the request came: it crossed a link for it
        w.early = true;
        early_.erase(e);
        // Kept for this request alone: an EVAL or a round uses it once.
        if (!msg::Hop::keeps_copies(w.msg.type)) holdings_.drop(r.key, r.part);
      }
      w.missing--;
      continue;
    }
    if (r.from.empty() || r.from == address_) {
      fail(w, i, WireErrc::kNotHeld, "tensor " + std::to_string(r.slot) + " was to be held here, but this peer no longer has it");
      continue;
    }
    if (cut_) continue;  // partitioned: times out
    if (auto l = late_fetches_.find({r.key, r.part}); l != late_fetches_.end()) {
      // Asked for by a request that gave up on it: that FETCH's answer is what this one waits for.
      auto f = fetching_.find(l->second);
      late_fetches_.erase(l);
      if (f != fetching_.end() && f->second.address == holder_of(r) && dialers_.count(f->second.address)) {
        f->second.request = wid;
        f->second.ref = i;
        w.early = true;
        continue;
      }
    }
    if (r.pushed) {
      // On its way: fetched only if it is late, at the pace this holder's tensors have come at,
      // behind those it is still pushing here.
      const std::string holder = holder_of(r);
      auto pace = s_per_mb_.find(holder);
      w.push_until[i] = now + timing::push_wait_s(r.desc.wire_bytes() + pushes_awaited(holder), w.window_s,
                                                  pace == s_per_mb_.end() ? 0 : pace->second);
      continue;
    }
    fetch(wid, w, i, now);
  }
}

void PeerLink::fetch(uint64_t wid, Waiting& w, size_t i, double now) {
  const wire::TensorRef& r = w.msg.refs[i];
  w.push_until[i] = 0;
  if (own_ && !valid_z85_key(r.from_key)) {
    fail(w, i, WireErrc::kUnreachable, "tensor " + std::to_string(r.slot) + "'s holder " + r.from + " has no key to check it by");
    return;
  }
  // One dialer per holder: its address and, under CURVE, the key it must prove it has.
  const std::string holder = own_ ? r.from + " " + r.from_key : r.from;
  msg::Fetch f;
  f.key = r.key;
  f.part = int32_t(r.part);
  const uint64_t fid = next_fetch_++;
  wire::Message q = msg::make(wire::MsgType::kFetch, f, fid);
  fetching_[fid] = Fetching{wid, i, holder, r.key, r.part, now};
  fetches++;
  if (!wire::send(*dialer(dialers_, holder, r.from_key, now, kFetchQueue).sock, q)) fail(w, i, WireErrc::kUnreachable, "cannot queue a FETCH to " + r.from);
}

void PeerLink::fail(Waiting& w, size_t ref, WireErrc code, const std::string& why, bool reached) {
  if (w.error) return;  // the first failure is the one reported
  msg::Error e;
  e.code = int32_t(code);
  e.name = wire_errc_name(code);
  e.message = why;
  e.request_type = int32_t(w.msg.type);
  e.tensor = int32_t(w.msg.refs[ref].slot);
  e.reached = reached;
  w.error = msg::make(e, w.msg.id, w.msg.attempt);
}

void PeerLink::arrived(const std::string& holder, uint64_t bytes, double since_s, double now) {
  double& heard = heard_[holder];
  const double from = std::max(since_s, heard);   // tensors back to back share the link: each is timed from the one before
  heard = now;
  if (bytes < timing::kPaceMinBytes || now <= from) return;
  double& pace = s_per_mb_[holder];
  pace = timing::ema(pace, (now - from) / (double(bytes) / 1e6));
}

uint64_t PeerLink::pushes_awaited(const std::string& holder) const {
  uint64_t bytes = 0;
  for (const auto& [wid, w] : waiting_)
    for (size_t i = 0; i < w.push_until.size(); ++i)
      if (w.push_until[i] > 0 && !w.got[i] && holder_of(w.msg.refs[i]) == holder) bytes += w.msg.refs[i].desc.wire_bytes();
  return bytes;
}

double PeerLink::heard_ago_s(const std::string& holder, double now) const {
  auto h = heard_.find(holder);
  return h == heard_.end() ? 1e300 : now - h->second;
}

void PeerLink::late_answer(uint64_t fid, const Fetching& fetch, wire::Received& r, double now) {
  if (auto l = late_fetches_.find({fetch.key, fetch.part}); l != late_fetches_.end() && l->second == fid) late_fetches_.erase(l);
  arrived(fetch.address, frames_bytes(r), fetch.sent_s, now);
  try {
    wire::Message m = wire::decode(r.frames);
    if (m.type != wire::MsgType::kFetched || m.tensors.size() != 1) return;
    // Kept as a push that came before its request is: checked against the reference when one
    // comes, and counted as fetched then.
    early_[{fetch.key, fetch.part}] = m.tensors[0].desc.wire_bytes();
    if (early_.size() > kMaxEarly) early_.erase(early_.begin());
    fetch_bytes += m.tensors[0].desc.wire_bytes();
    holdings_.put(fetch.key, fetch.part, std::move(m.tensors[0]), true, now);
  } catch (const InputError&) {
    // Damaged: a request that wants it fetches it again.
  }
}

void PeerLink::on_fetch_reply(wire::Received& r, const std::string& address, double now) {
  const std::optional<uint64_t> fid = wire::peek_id(r.frames);
  if (!fid) return;
  auto f = fetching_.find(*fid);
  if (f == fetching_.end() || f->second.address != address) return;  // late: its request timed out
  const Fetching fetch = f->second;
  fetching_.erase(f);
  if (fetch.request == 0) return late_answer(*fid, fetch, r, now);
  arrived(address, frames_bytes(r), fetch.sent_s, now);
  auto wi = waiting_.find(fetch.request);
  if (wi == waiting_.end()) return;
  Waiting& w = wi->second;
  if (w.got[fetch.ref]) return;  // its push came first
  const wire::TensorRef& ref = w.msg.refs[fetch.ref];
  try {
    wire::Message m = wire::decode(r.frames);
    if (m.type == wire::MsgType::kError) {
      const msg::Error e = msg::read<msg::Error>(m);
      return fail(w, fetch.ref, e.code == int(WireErrc::kNotHeld) ? WireErrc::kNotHeld : WireErrc::kUnreachable,
                  "fetching tensor " + std::to_string(ref.slot) + " from " + address + ": " + e.message);
    }
    if (m.type != wire::MsgType::kFetched || m.tensors.size() != 1)
      throw WireError(WireErrc::kBadTensor, std::string("answered ") + wire::msg_type_name(m.type) + " to a FETCH");
    if (!wire::same_tensor(m.tensors[0].desc, ref.desc))
      throw WireError(WireErrc::kBadTensor, "not the tensor referenced (" + std::to_string(m.tensors[0].desc.nbytes) + " bytes, checksum " +
                                                std::to_string(m.tensors[0].desc.checksum) + ")");
    fetch_bytes += m.tensors[0].desc.wire_bytes();
    fetched_from[address] += m.tensors[0].desc.wire_bytes();
    w.fetched[ref.slot] += int64_t(m.tensors[0].desc.wire_bytes());
    w.came_s = now;
    w.got[fetch.ref] = std::move(m.tensors[0]);
    w.missing--;
  } catch (const InputError& e) {
    // Damaged or not what was asked for: the holder's doing, as far as this peer can tell.
    msg::Error err;
    err.code = int32_t(WireErrc::kBadTensor);
    err.name = wire_errc_name(WireErrc::kBadTensor);
    err.message = "tensor " + std::to_string(ref.slot) + " fetched from " + address + " is bad: " + e.what();
    err.request_type = int32_t(w.msg.type);
    err.tensor = int32_t(ref.slot);
    if (!w.error) w.error = msg::make(err, w.msg.id, w.msg.attempt);
  }
}

std::vector<PeerLink::Resolved> PeerLink::take(double now) {
  std::vector<Resolved> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = it->second;
    // A push that did not come in time: fetched after all (its holder may not reach this peer).
    for (size_t i = 0; i < w.push_until.size() && !w.error && !cut_; ++i)
      if (w.push_until[i] > 0 && !w.got[i] && now >= w.push_until[i]) {
        push_late++;
        w.push_late++;
        late_[{w.msg.refs[i].key, w.msg.refs[i].part}] = GivenUp{w.arrived_s, holder_of(w.msg.refs[i])};
        if (late_.size() > kMaxEarly) late_.erase(late_.begin());
        fetch(it->first, w, i, now);
      }
    if (!w.error && w.missing > 0 && now > w.deadline) {
      for (size_t i = 0; i < w.got.size(); ++i)
        if (!w.got[i]) {
          const wire::TensorRef& r = w.msg.refs[i];
          std::string why = "could not fetch tensor " + std::to_string(r.slot) + " from " + r.from + " within " + shortest_number(w.window_s) + " s";
          const double heard = heard_ago_s(holder_of(r), now);
          if (heard <= timing::kHeardWithinS) why += " (it sent this peer a tensor " + shortest_number(std::round(heard * 100) / 100) + " s ago: a busy link)";
          fail(w, i, WireErrc::kUnreachable, why, heard <= timing::kHeardWithinS);
          break;
        }
      // A holder that did not answer and has not been heard from lately: its queued FETCHes go
      // with its socket. One heard from lately keeps it: its answer is on the way.
      for (size_t i = 0; i < w.got.size(); ++i)
        if (!w.got[i] && heard_ago_s(holder_of(w.msg.refs[i]), now) > timing::kHeardWithinS) dialers_.erase(holder_of(w.msg.refs[i]));
    }
    if (!w.error && w.missing > 0) {
      ++it;
      continue;
    }
    Resolved r;
    r.seq = w.seq;
    r.fetched = std::move(w.fetched);
    r.push_late = w.push_late;
    r.fetch_s = !w.early && w.came_s > 0 ? w.came_s - w.arrived_s : 0;
    if (!w.error) {
      std::vector<wire::Tensor> got;
      for (auto& t : w.got) got.push_back(std::move(*t));
      // Copies of what came from elsewhere, for a BACKWARD that comes back here.
      for (size_t i = 0; i < w.msg.refs.size() && msg::Hop::keeps_copies(w.msg.type); ++i)
        if (r.fetched[w.msg.refs[i].slot] > 0) holdings_.put(w.msg.refs[i].key, w.msg.refs[i].part, wire::share(got[i]), true, now);
      wire::resolve(w.msg, std::move(got));  // every tensor was checked against its reference on arrival
    }
    // Fetches still out for a failed request are forgotten (their replies dropped), but for
    // those to a holder whose socket stays open (heard from lately): their answers are kept.
    for (auto f = fetching_.begin(); f != fetching_.end();) {
      if (f->second.request != it->first) {
        ++f;
        continue;
      }
      if (!w.error || !dialers_.count(f->second.address)) {
        f = fetching_.erase(f);
        continue;
      }
      f->second.request = 0;
      late_fetches_[{f->second.key, f->second.part}] = f->first;
      if (late_fetches_.size() > kMaxEarly) {
        fetching_.erase(late_fetches_.begin()->second);
        late_fetches_.erase(late_fetches_.begin());
      }
      ++f;
    }
    if (w.error) {
      failed++;
      r.error = std::move(w.error);
    } else {
      r.msg = std::move(w.msg);
    }
    out.push_back(std::move(r));
    it = waiting_.erase(it);
  }
  return out;
}

}  // namespace swarm
