// test_peer_link.cpp: the stage server's peer-to-peer side over real loopback sockets: a peer
// fetching what another holds, what is not held, a holder that never answers, a holder that
// serves something else than it referenced, the holdings' bounds and their zero-copy shares.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "runtime/messages.h"
#include "stages/holdings.h"
#include "stages/peer_link.h"

namespace swarm {
namespace {

using Clock = std::chrono::steady_clock;

wire::Tensor floats(size_t n, float v) {
  wire::Tensor t = wire::make_tensor(wire::DType::kF32, {int64_t(n)}, compression::CodecSpec{}, n * 4);
  auto* p = static_cast<float*>(t.data.data());
  for (size_t i = 0; i < n; ++i) p[i] = v + float(i);
  wire::seal(t);
  return t;
}

// A BACKWARD whose two tensors are held elsewhere.
wire::Message request_with_refs(const std::string& from, const wire::TensorDesc& a, const wire::TensorDesc& b) {
  msg::Hop h;
  h.job_id = 1;
  h.mb = 3;
  h.stage = 1;
  wire::Message m = msg::make(wire::MsgType::kBackward, h, 77, 2);
  wire::TensorRef r0;
  r0.slot = 0;
  r0.from = from;
  r0.key = 10;
  r0.desc = a;
  wire::TensorRef r1 = r0;
  r1.slot = 1;
  r1.key = 11;
  r1.desc = b;
  m.refs = {r0, r1};
  return m;
}

// Polls `link`, and `holder` unless it is null (a holder too busy to answer), until `link` has
// resolved something (or `seconds` pass). Their clock reads `from_s` as it starts.
std::vector<PeerLink::Resolved> pump_links(PeerLink* holder, PeerLink& link, double seconds, double from_s = 0) {
  const auto t0 = Clock::now();
  for (;;) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count(), now = from_s + elapsed;
    std::vector<zmq::pollitem_t> items;
    if (holder) holder->add_poll_items(items);
    const size_t mine = items.size();
    link.add_poll_items(items);
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(5));
    if (holder) holder->ready(items, 0, now);
    link.ready(items, mine, now);
    auto out = link.take(now);
    if (!out.empty() || elapsed > seconds) return out;
  }
}

std::vector<PeerLink::Resolved> pump(PeerLink& holder, PeerLink& link, double seconds = 5, double from_s = 0) { return pump_links(&holder, link, seconds, from_s); }
std::vector<PeerLink::Resolved> pump_alone(PeerLink& link) { return pump_links(nullptr, link, 5); }

msg::Error error_of(const PeerLink::Resolved& r) {
  EXPECT_TRUE(r.error.has_value());
  return msg::read<msg::Error>(*r.error);
}

struct Pair {
  zmq::context_t ctx{1};
  Holdings held{1 << 20, 600, 60}, mine{1 << 20, 600, 60};
  PeerLink holder{ctx, "tcp://127.0.0.1:*", "", held, 1.0};
  PeerLink link{ctx, "", "", mine, 1.0};
  // The holder keeps tensors 10 (n floats from 1) and 11 (m floats from 2); their descriptions.
  std::pair<wire::TensorDesc, wire::TensorDesc> hold(size_t n, size_t m) {
    wire::Tensor a = floats(n, 1), b = floats(m, 2);
    std::pair<wire::TensorDesc, wire::TensorDesc> out{a.desc, b.desc};
    held.put(10, 0, std::move(a), false, 0);
    held.put(11, 0, std::move(b), false, 0);
    return out;
  }
};

TEST(PeerLink, ARequestIsWholeOnceEveryReferenceIsFetchedFromItsHolder) {
  Pair p;
  const auto [da, db] = p.hold(1000, 500);
  ASSERT_FALSE(p.holder.address().empty());
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 5, 0);
  auto out = pump(p.holder, p.link);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error) << msg::read<msg::Error>(*out[0].error).message;
  const wire::Message& m = out[0].msg;
  EXPECT_EQ(m.id, 77u);
  EXPECT_EQ(m.attempt, 2u);
  EXPECT_EQ(out[0].seq, 5u);
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_TRUE(m.refs.empty());
  EXPECT_TRUE(wire::same_tensor(m.tensors[0].desc, da));
  EXPECT_TRUE(wire::same_tensor(m.tensors[1].desc, db));
  EXPECT_EQ(static_cast<const float*>(m.tensors[1].data.data())[499], 2.f + 499);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{4000, 2000}));
  // A copy stays: the BACKWARD that comes back needs no second fetch.
  EXPECT_TRUE(p.mine.get(10, 0).has_value());
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 6, 0);
  out = p.link.take(0);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{0, 0}));
  // Until the router releases it with its microbatch.
  p.mine.release(10);
  p.mine.release(11);
  // What an EVAL fetched is used once: no copy.
  wire::Message eval = request_with_refs(p.holder.address(), da, db);
  eval.type = wire::MsgType::kEval;
  p.link.resolve(std::move(eval), 7, 0);
  out = pump(p.holder, p.link);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{4000, 2000}));
  EXPECT_EQ(p.mine.size(), 0u);
}

// Both ends listen, as peers that hold do: the router may ask the holder to push.
struct ListeningPair {
  zmq::context_t ctx{1};
  Holdings held{1 << 20, 600, 60}, mine{1 << 20, 600, 60};
  PeerLink holder{ctx, "tcp://127.0.0.1:*", "", held, 1.0};
  PeerLink link{ctx, "tcp://127.0.0.1:*", "", mine, 1.0};
  wire::TensorDesc da, db;
  // The holder keeps tensors 10 (n floats from 1) and 11 (m floats from 2); a BACKWARD that
  // references both, marked pushed.
  wire::Message pushed_request(size_t n, size_t m) {
    wire::Tensor a = floats(n, 1), b = floats(m, 2);
    da = a.desc;
    db = b.desc;
    held.put(10, 0, std::move(a), false, 0);
    held.put(11, 0, std::move(b), false, 0);
    wire::Message req = request_with_refs(holder.address(), da, db);
    for (auto& r : req.refs) r.pushed = true;
    return req;
  }
};

msg::Push push_of(uint64_t key, const std::string& to) {
  msg::Push pu;
  pu.key = key;
  pu.to = to;
  return pu;
}

// Tensor `key` (n floats) made at the holder and pushed to the receiver before any request names
// it; then a request of `type` (arrival number `seq`) whose one reference is that tensor, pushed.
std::vector<PeerLink::Resolved> early_push_then_request(ListeningPair& p, wire::MsgType type, uint64_t key, size_t n, uint64_t seq) {
  wire::Tensor t = floats(n, float(key));
  const wire::TensorDesc d = t.desc;
  p.held.put(key, 0, std::move(t), false, 0);
  const uint64_t before = p.link.pushed_in;
  p.holder.push(push_of(key, p.link.address()), 0);
  for (int i = 0; i < 400 && p.link.pushed_in == before; ++i) pump(p.holder, p.link, 0.005);
  EXPECT_EQ(p.link.pushed_in, before + 1);
  EXPECT_TRUE(p.mine.get(key, 0).has_value());
  wire::Message m = request_with_refs(p.holder.address(), d, d);
  m.type = type;
  m.refs.resize(1);
  m.refs[0].key = key;
  m.refs[0].pushed = true;
  p.link.resolve(std::move(m), seq, 0);
  return p.link.take(0);
}

// The router's PUSH: the holder sends the tensors to the receiver before it asks, and a request
// whose references say so is whole without a FETCH, whether the pushes come after it or before.
TEST(PeerLink, PushedTensorsMakeARequestWholeWithoutAFetch) {
  ListeningPair p;
  p.link.resolve(p.pushed_request(1000, 500), 5, 0);
  p.holder.push(push_of(10, p.link.address()), 0);
  p.holder.push(push_of(11, p.link.address()), 0);
  auto out = pump(p.holder, p.link, 0.4);   // well before the pushes are waited for (0.5 s)
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error) << msg::read<msg::Error>(*out[0].error).message;
  EXPECT_EQ(p.link.fetches, 0u);
  EXPECT_EQ(p.holder.pushes, 2u);
  EXPECT_EQ(p.link.pushed_in, 2u);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{4000, 2000}));
  EXPECT_TRUE(wire::same_tensor(out[0].msg.tensors[1].desc, p.db));
  EXPECT_EQ(static_cast<const float*>(out[0].msg.tensors[1].data.data())[499], 2.f + 499);

  // Pushed before the request came: kept as a copy, and counted as crossing the link once.
  out = early_push_then_request(p, wire::MsgType::kBackward, 12, 200, 6);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{800}));
  EXPECT_EQ(p.link.fetches, 0u);
  EXPECT_TRUE(p.mine.get(12, 0).has_value());   // a training hop's: until the router releases it

  // An EVAL uses what was pushed to it once: the copy goes as the request takes it.
  out = early_push_then_request(p, wire::MsgType::kEval, 13, 100, 7);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error);
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{400}));
  EXPECT_FALSE(p.mine.get(13, 0).has_value());
}

// A push that does not come (its holder could not reach this peer, or no longer had it) is
// fetched once it is late: the request still resolves.
TEST(PeerLink, APushThatDoesNotComeIsFetchedOnceItIsLate) {
  ListeningPair p;
  wire::Message req = p.pushed_request(100, 100);
  const auto t0 = Clock::now();
  p.link.resolve(std::move(req), 1, 0);
  auto out = pump(p.holder, p.link, 3);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error) << msg::read<msg::Error>(*out[0].error).message;
  EXPECT_EQ(p.link.push_late, 2u);
  EXPECT_EQ(p.link.fetches, 2u);
  EXPECT_GE(took, 0.5);   // half the 1 s window: timing::push_wait_s
  // The router releases the copies once the stage is done; a push that comes after that is not
  // kept (nothing would release it before its time to live).
  p.mine.release(10);
  p.mine.release(11);
  p.holder.push(push_of(10, p.link.address()), 0);
  for (int i = 0; i < 400 && p.link.pushed_in < 1; ++i) pump(p.holder, p.link, 0.005);
  ASSERT_EQ(p.link.pushed_in, 1u);
  EXPECT_EQ(p.mine.size(), 0u);
}

// A push is waited for at the pace its holder's tensors have come at, where that is slower than
// the 10 MB/s timing::push_wait_s assumes: on a slow link a push fetched again once that wait
// passed crossed the link twice, and three such made the router stop pushing to the peer.
TEST(PeerLink, APushIsWaitedForAtThePaceItsHoldersTensorsHaveComeAt) {
  zmq::context_t ctx{1};
  Holdings held{8 << 20, 600, 60}, other_held{8 << 20, 600, 60}, mine{8 << 20, 600, 60};
  PeerLink holder{ctx, "tcp://127.0.0.1:*", "", held, 60.0}, other{ctx, "tcp://127.0.0.1:*", "", other_held, 60.0};
  PeerLink link{ctx, "tcp://127.0.0.1:*", "", mine, 60.0};
  const size_t n = 100000;   // 400 KB a tensor
  auto request = [&](PeerLink& from, Holdings& h, uint64_t key, bool pushed) {
    wire::Tensor t = floats(n, float(key));
    const wire::TensorDesc d = t.desc;
    h.put(key, 0, std::move(t), false, 0);
    wire::Message m = request_with_refs(from.address(), d, d);
    m.refs.resize(1);
    m.refs[0].key = key;
    m.refs[0].pushed = pushed;
    return m;
  };
  // Tensor 10 fetched from the holder, its answer read 8 s after the request came: 20 s a MB.
  link.resolve(request(holder, held, 10, false), 1, 0);
  auto out = pump(holder, link, 5, 8);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error);
  // Tensor 11 from the same holder, pushed, its request come at 10 s: not fetched at 11.04 s
  // (1 s plus 400 KB at 10 MB/s), but waited for while it takes 9 s at that pace.
  link.resolve(request(holder, held, 11, true), 2, 10);
  EXPECT_TRUE(pump_links(nullptr, link, 0.1, 12).empty());
  EXPECT_EQ(link.fetches, 1u);
  EXPECT_EQ(link.push_late, 0u);
  holder.push(push_of(11, link.address()), 12.5);
  out = pump(holder, link, 5, 13);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error);
  EXPECT_EQ(out[0].push_late, 0);
  EXPECT_EQ(link.fetches, 1u);
  // Another holder, whose pace this peer has not seen: fetched once 10 MB/s would have brought it.
  link.resolve(request(other, other_held, 12, true), 3, 20);
  EXPECT_TRUE(pump_links(nullptr, link, 0.1, 21.1).empty());
  EXPECT_EQ(link.push_late, 1u);
  out = pump(other, link, 5, 21.2);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error);
  EXPECT_EQ(out[0].push_late, 1);
  EXPECT_EQ(link.fetches, 2u);
}

TEST(PeerLink, ATensorItsHolderNoLongerHasFailsTheRequestNamingTheTensor) {
  Pair p;
  const auto [da, db] = p.hold(100, 100);
  p.held.release(11);
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 1, 0);
  auto out = pump(p.holder, p.link);
  ASSERT_EQ(out.size(), 1u);
  const msg::Error e = error_of(out[0]);
  EXPECT_EQ(e.code, int(WireErrc::kNotHeld));
  EXPECT_EQ(e.tensor.value_or(-1), 1);
  EXPECT_EQ(out[0].error->id, 77u);
}

TEST(PeerLink, AHolderThatNeverAnswersFailsTheRequestAsUnreachableAfterTheTimeout) {
  Pair p;
  // Nobody listens at this address: the FETCH waits in its queue until the timeout.
  zmq::socket_t probe(p.ctx, zmq::socket_type::router);
  probe.bind("tcp://127.0.0.1:*");
  const std::string nobody = probe.get(zmq::sockopt::last_endpoint);
  probe.close();
  const wire::TensorDesc d = floats(10, 0).desc;
  p.link.resolve(request_with_refs(nobody, d, d), 1, 0);
  auto out = pump(p.holder, p.link, 3);
  ASSERT_EQ(out.size(), 1u);
  const msg::Error e = error_of(out[0]);
  EXPECT_EQ(e.code, int(WireErrc::kUnreachable));
  EXPECT_EQ(e.tensor.value_or(-1), 0);
  EXPECT_NE(e.message.find(nobody), std::string::npos) << e.message;
  EXPECT_FALSE(e.reached);   // never heard from: nothing says the link works
}

// A holder that sent this peer tensors a moment ago, and whose answer does not come within the
// window (a full link), is reported as reached; its answer still comes, and the request the
// router sends again waits for it instead of asking a second time.
TEST(PeerLink, AHolderHeardFromLatelyIsABusyLinkAndItsLateAnswerServesTheRequestSentAgain) {
  Pair p;
  const auto [da, db] = p.hold(1000, 500);
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 1, 0);
  ASSERT_EQ(pump(p.holder, p.link).size(), 1u);
  p.mine.release(10);   // the router released the copies: the next request fetches again
  p.mine.release(11);
  // The holder is too busy to answer within the 1-s window.
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 2, 0);
  std::vector<PeerLink::Resolved> out = pump_alone(p.link);
  ASSERT_EQ(out.size(), 1u);
  const msg::Error e = error_of(out[0]);
  EXPECT_EQ(e.code, int(WireErrc::kUnreachable));
  EXPECT_TRUE(e.reached) << e.message;
  EXPECT_NE(e.message.find("a busy link"), std::string::npos) << e.message;
  EXPECT_EQ(p.link.fetches, 4u);
  // Sent again, here: it takes over the FETCHes still out, and is whole once they are answered.
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 3, 0);
  out = pump(p.holder, p.link);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error) << msg::read<msg::Error>(*out[0].error).message;
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{4000, 2000}));
  EXPECT_EQ(p.link.fetches, 4u);   // no third FETCH of either
  EXPECT_EQ(p.holder.served, 4u);
}

// The late answers come before the request is sent again: they are kept as copies, and the
// request is whole at once, counting what crossed the link for it.
TEST(PeerLink, LateAnswersThatComeBeforeTheRequestIsSentAgainAreKeptForIt) {
  Pair p;
  const auto [da, db] = p.hold(1000, 500);
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 1, 0);
  ASSERT_EQ(pump(p.holder, p.link).size(), 1u);
  p.mine.release(10);
  p.mine.release(11);
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 2, 0);
  ASSERT_EQ(pump_alone(p.link).size(), 1u);
  EXPECT_TRUE(pump(p.holder, p.link, 0.5).empty());   // the answers come; no request waits for them
  EXPECT_EQ(p.holder.served, 4u);
  EXPECT_EQ(p.mine.size(), 2u);
  p.link.resolve(request_with_refs(p.holder.address(), da, db), 3, 0);
  auto out = p.link.take(0);
  ASSERT_EQ(out.size(), 1u);
  ASSERT_FALSE(out[0].error) << msg::read<msg::Error>(*out[0].error).message;
  EXPECT_EQ(out[0].fetched, (std::vector<int64_t>{4000, 2000}));
  EXPECT_EQ(p.link.fetches, 4u);
}

// The router asks for an answer before its deadline: a request's fetch_within_ms (through the
// wire and back) cuts a peer's own, longer timeout short, and the error says how long it waited.
TEST(PeerLink, ARequestThatAsksForAnAnswerSoonerIsFailedWithinItsWindow) {
  zmq::context_t ctx{1};
  Holdings held{1 << 20, 600, 60}, mine{1 << 20, 600, 60};
  PeerLink holder{ctx, "tcp://127.0.0.1:*", "", held, 30.0}, link{ctx, "", "", mine, 30.0};
  zmq::socket_t probe(ctx, zmq::socket_type::router);
  probe.bind("tcp://127.0.0.1:*");
  const std::string nobody = probe.get(zmq::sockopt::last_endpoint);
  probe.close();
  const wire::TensorDesc d = floats(10, 0).desc;
  wire::Message m = request_with_refs(nobody, d, d);
  m.fetch_within_ms = 300;
  auto frames = wire::encode(m);
  wire::Message sent = wire::decode(frames);
  ASSERT_EQ(sent.fetch_within_ms, 300u);
  const auto t0 = Clock::now();
  link.resolve(std::move(sent), 1, 0);
  auto out = pump(holder, link, 5);
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(out.size(), 1u);
  const msg::Error e = error_of(out[0]);
  EXPECT_EQ(e.code, int(WireErrc::kUnreachable));
  EXPECT_NE(e.message.find("within 0.3 s"), std::string::npos) << e.message;
  EXPECT_LT(waited, 5.0) << "waited for the peer's own 30-s timeout";
  // Without it, the peer's own timeout holds: nothing is failed in the same time.
  link.resolve(request_with_refs(nobody, d, d), 2, 0);
  EXPECT_TRUE(pump(holder, link, 1).empty());
}

TEST(PeerLink, ATensorThatIsNotTheOneReferencedIsABadTensorOfItsMaker) {
  Pair p;
  wire::Tensor a = floats(100, 1), b = floats(100, 2);
  wire::TensorDesc claimed = a.desc;
  claimed.checksum ^= 1;  // what the holder told the router it made
  const wire::TensorDesc db = b.desc;
  p.held.put(10, 0, std::move(a), false, 0);
  p.held.put(11, 0, std::move(b), false, 0);
  p.link.resolve(request_with_refs(p.holder.address(), claimed, db), 1, 0);
  auto out = pump(p.holder, p.link);
  ASSERT_EQ(out.size(), 1u);
  const msg::Error e = error_of(out[0]);
  EXPECT_EQ(e.code, int(WireErrc::kBadTensor));
  EXPECT_EQ(e.tensor.value_or(-1), 0);
}

TEST(PeerLink, AWildcardListenAddressNeedsAnAdvertisedOne) {
  zmq::context_t ctx(1);
  Holdings h(1 << 20, 600, 60);
  try {
    PeerLink link(ctx, "tcp://0.0.0.0:*", "", h, 1.0);
    FAIL() << "a wildcard bind without --advertise was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--advertise"), std::string::npos) << e.what();
  }
  PeerLink ok(ctx, "tcp://0.0.0.0:*", "tcp://10.1.2.3:7000", h, 1.0);
  EXPECT_EQ(ok.address(), "tcp://10.1.2.3:7000");
}

TEST(Holdings, CopiesGoFirstThenTheOldestWhenFullAndEverythingExpires) {
  Holdings h(10 * 400, /*held_ttl_s=*/100, /*copy_ttl_s=*/10);
  for (uint64_t k = 1; k <= 8; ++k) h.put(k, 0, floats(100, float(k)), false, double(k));
  h.put(20, 0, floats(100, 0), true, 9);
  h.put(21, 0, floats(100, 0), true, 9.5);
  EXPECT_EQ(h.size(), 10u);
  h.put(9, 0, floats(100, 9), false, 10);  // full: the older copy goes
  EXPECT_FALSE(h.get(20, 0));
  EXPECT_TRUE(h.get(21, 0));
  h.put(10, 0, floats(100, 9), false, 11);  // then the other copy
  h.put(12, 0, floats(100, 9), false, 12);  // then the oldest held one
  EXPECT_FALSE(h.get(21, 0));
  EXPECT_FALSE(h.get(1, 0));
  EXPECT_TRUE(h.get(2, 0));
  EXPECT_EQ(h.evicted(), 3u);
  EXPECT_LE(h.bytes(), 10u * 400);
  h.expire(105);  // held entries older than 100 s
  EXPECT_FALSE(h.get(4, 0));
  EXPECT_TRUE(h.get(5, 0));
  h.release(5);
  EXPECT_FALSE(h.get(5, 0));
  h.put(30, 0, floats(100, 0), true, 106);  // a copy goes on RELEASE as well
  h.release(30);
  EXPECT_FALSE(h.get(30, 0));
}

TEST(Holdings, AShareIsZeroCopy) {
  Holdings h(1 << 20, 100, 10);
  h.put(1, 0, floats(1000, 3), false, 0);
  auto a = h.get(1, 0), b = h.get(1, 0);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->data.data(), b->data.data());
}

}  // namespace
}  // namespace swarm
