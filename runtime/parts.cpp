// parts.cpp: a large message as PARTs and back (see parts.h). The envelopes and part 0's header
// are written by encode and read by msg::read, as any other message's.
#include "runtime/parts.h"

#include <cstring>
#include <memory>

#include "runtime/messages.h"

namespace swarm::wire {

namespace {

// A piece of a frame that shares its buffer: the frame lives until its last piece is sent.
zmq::message_t piece_of(const std::shared_ptr<zmq::message_t>& frame, size_t offset, size_t n) {
  if (n <= 256) return zmq::message_t(static_cast<const char*>(frame->data()) + offset, n);   // cheaper copied
  auto* owner = new std::shared_ptr<zmq::message_t>(frame);
  return zmq::message_t(static_cast<char*>(frame->data()) + offset, n,
                        [](void*, void* hint) { delete static_cast<std::shared_ptr<zmq::message_t>*>(hint); }, owner);
}

}  // namespace

uint64_t frame_bytes(const std::vector<zmq::message_t>& frames) {
  uint64_t total = 0;
  for (const auto& f : frames) total += f.size();
  return total;
}

std::vector<std::vector<zmq::message_t>> split_parts(std::vector<zmq::message_t> frames, size_t part_bytes) {
  SWARM_CHECK(part_bytes > 0 && part_bytes <= limits::kMaxPartBytes, "a PART holds 1 to kMaxPartBytes bytes");
  std::vector<std::vector<zmq::message_t>> out;
  if (frame_bytes(frames) <= part_bytes) {
    out.push_back(std::move(frames));
    return out;
  }
  msg::PartHeader header;
  for (const auto& f : frames) header.frames.push_back(int64_t(f.size()));
  std::vector<zmq::message_t> part;
  size_t room = 0;   // bytes the part being filled can still take
  auto start = [&] {
    if (!part.empty()) out.push_back(std::move(part));
    // Its envelope and header: part 0 declares the frames, the others carry an empty map.
    Message head(MsgType::kPart, out.size(), 0, out.empty() ? msg::pack(header) : std::string());
    part = encode(head);
    room = part_bytes;
  };
  start();
  for (auto& f : frames) {
    const auto frame = std::make_shared<zmq::message_t>(std::move(f));
    for (size_t at = 0; at < frame->size();) {
      if (room == 0) start();
      const size_t n = std::min(room, frame->size() - at);
      part.push_back(piece_of(frame, at, n));
      at += n;
      room -= n;
    }
  }
  out.push_back(std::move(part));
  return out;
}

bool send_parted(zmq::socket_t& s, std::vector<zmq::message_t> frames, const std::string* route, size_t part_bytes) {
  for (auto& m : split_parts(std::move(frames), part_bytes))
    if (!send_frames(s, m, route)) return false;
  return true;
}

bool send_parted(zmq::socket_t& s, Message& m, const std::string* route, size_t part_bytes) { return send_parted(s, encode(m), route, part_bytes); }

std::optional<std::vector<zmq::message_t>> PartJoiner::take(const std::string& from, std::vector<zmq::message_t> frames, double now_s) {
  Envelope env;
  try {
    env = peek_envelope(frames);
  } catch (const WireError&) {
    return frames;   // decode says what is wrong with it
  }
  if (env.type != MsgType::kPart) return frames;
  auto it = open_.find(from);
  if (env.id == 0 && it != open_.end()) {
    open_.erase(it);
    it = open_.end();
  }
  // Any failure from here on drops what `from` had unfinished.
  auto drop = [&](WireErrc code, const std::string& what) -> std::optional<std::vector<zmq::message_t>> {
    open_.erase(from);
    throw WireError(code, "PART " + std::to_string(env.id) + ": " + what);
  };
  if (frames[1].size() > limits::kMaxPartHeaderBytes) return drop(WireErrc::kTooLarge, "frame 1 is over the limit");
  if (it == open_.end()) {
    if (env.id != 0) return drop(WireErrc::kOutOfOrder, "came with no part 0 before it (or after a part that was dropped)");
    Message head(MsgType::kPart, 0, 0, std::string(static_cast<const char*>(frames[1].data()), frames[1].size()));
    const msg::PartHeader h = msg::read<msg::PartHeader>(head);   // each size within the message limit
    if (h.frames.size() < 2) return drop(WireErrc::kMalformed, "part 0 must declare the size of each of the message's 2 or more frames");
    Unfinished u;
    uint64_t total = 0;
    for (const int64_t n : h.frames) {
      if ((total += uint64_t(n)) > limits::kMaxMessageBytes)
        return drop(WireErrc::kTooLarge, "the message's frames declare more than the message limit of " + std::to_string(limits::kMaxMessageBytes) + " bytes");
      u.sizes.push_back(uint64_t(n));
    }
    u.frames.resize(u.sizes.size());
    it = open_.emplace(from, std::move(u)).first;
  } else if (env.id != it->second.next) {
    return drop(WireErrc::kOutOfOrder, "came where part " + std::to_string(it->second.next) + " was due");
  }
  Unfinished& u = it->second;
  auto skip_filled = [&u] {   // past the frames already whole (and the empty ones, which get no piece)
    while (u.frame < u.sizes.size() && u.filled == u.sizes[u.frame]) {
      u.frame++;
      u.filled = 0;
    }
  };
  uint64_t bytes = 0;
  for (size_t i = 2; i < frames.size(); ++i) {
    const zmq::message_t& piece = frames[i];
    skip_filled();
    if (piece.size() == 0) return drop(WireErrc::kMalformed, "piece " + std::to_string(i - 2) + " is empty");
    if ((bytes += piece.size()) > limits::kMaxPartBytes) return drop(WireErrc::kTooLarge, "its pieces hold more than " + std::to_string(limits::kMaxPartBytes) + " bytes");
    if (u.frame == u.sizes.size() || piece.size() > u.sizes[u.frame] - u.filled)
      return drop(WireErrc::kMalformed, "piece " + std::to_string(i - 2) + " runs past the frames part 0 declared");
    if (u.filled == 0) u.frames[u.frame] = zmq::message_t(size_t(u.sizes[u.frame]));
    std::memcpy(static_cast<char*>(u.frames[u.frame].data()) + u.filled, piece.data(), piece.size());
    u.filled += piece.size();
  }
  if (bytes == 0) return drop(WireErrc::kMalformed, "carries no piece");
  u.next++;
  u.last_s = now_s;
  skip_filled();
  if (u.frame < u.sizes.size()) return std::nullopt;
  std::vector<zmq::message_t> whole = std::move(u.frames);
  open_.erase(it);
  return whole;
}

void PartJoiner::expire(double now_s, double idle_s) {
  for (auto it = open_.begin(); it != open_.end();) it = now_s - it->second.last_s > idle_s ? open_.erase(it) : std::next(it);
}

void PartJoiner::forget(const std::string& from) { open_.erase(from); }

}  // namespace swarm::wire
