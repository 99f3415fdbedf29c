// parts.h: a large message as a run of PART messages, and back (docs/protocol.md, "Parts").
//
// Defines swarm::wire::frame_bytes, `split_parts` (a message's frames -> its PARTs, the pieces
// sharing the frames' buffers), `send_parted` and PartJoiner (PARTs -> the message, one
// unfinished message per sender, every limit checked before anything is allocated). The
// router, swarm-stage, the CLI client and the conformance kit use them on the connections
// between the router and its stage servers and clients.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "runtime/limits.h"
#include "runtime/wire.h"

namespace swarm::wire {

// Between the router and a stage server or client, a message whose frames hold more than
// limits::kMaxPartBytes goes as a run of PART messages, each a whole ZeroMQ message of at most
// that many of its bytes, to a receiver that said it takes them (HELLO.parts, WELCOME.parts). ZeroMQ hands a message over only once all of it has arrived, so a
// large one on a slow link (a stage's state, outer gradients through the router) would leave
// its receiver hearing nothing from the sender for as long as it takes: the router and a
// stage server count every PART as a sign of life, and so do ZeroMQ's own heartbeats.
//
// PART i: frame 0 an envelope of type PART with id i (attempt 0); frame 1 a msgpack map, for
// i = 0 {"frames": [the size of each frame of the message]} and empty after; then pieces, the
// message's frames in order, each cut at most kMaxPartBytes at a time, a part's pieces together
// at most kMaxPartBytes. A piece never spans two frames; empty frames have none.

// Their bytes together.
uint64_t frame_bytes(const std::vector<zmq::message_t>& frames);
// The messages that carry `frames`: the frames themselves when they hold at most `part_bytes`
// together, else its PARTs of at most `part_bytes` (1 to kMaxPartBytes: a receiver takes a
// message in parts of any size within that). The pieces share the frames' buffers (no copy).
std::vector<std::vector<zmq::message_t>> split_parts(std::vector<zmq::message_t> frames, size_t part_bytes = limits::kMaxPartBytes);
// send_frames for each message split_parts gives. false as soon as one cannot go; the parts after
// it are dropped, and the receiver drops the unfinished message (PartJoiner).
bool send_parted(zmq::socket_t& s, std::vector<zmq::message_t> frames, const std::string* route = nullptr,
                 size_t part_bytes = limits::kMaxPartBytes);
// Encodes m and sends it with send_parted.
bool send_parted(zmq::socket_t& s, Message& m, const std::string* route = nullptr, size_t part_bytes = limits::kMaxPartBytes);

// Puts messages that came in PARTs back together, one unfinished message per sender (a route on
// a ROUTER socket; "" on a DEALER). Part 0 declares every frame's size, checked against the
// limits before anything is allocated; a frame is allocated at its size as its first piece
// comes. What a sender can make a receiver hold is what one whole message could.
class PartJoiner {
 public:
  // One message received from `from`. Anything but a PART comes back as it is (undecodable
  // frames too, for decode to report). A PART is kept, and the message it completes comes back
  // whole; nullopt until then. Throws WireError when a part comes out of sequence, is over a
  // limit or does not fit what part 0 declared; the unfinished message is dropped with it. A
  // part 0 from a sender with a message unfinished starts over (its connection was made anew).
  std::optional<std::vector<zmq::message_t>> take(const std::string& from, std::vector<zmq::message_t> frames, double now_s);
  // Drops the unfinished messages whose last part came more than `idle_s` before `now_s`.
  void expire(double now_s, double idle_s);
  void forget(const std::string& from);
  size_t unfinished() const { return open_.size(); }

 private:
  struct Unfinished {
    std::vector<zmq::message_t> frames;   // allocated as their first piece comes
    std::vector<uint64_t> sizes;
    size_t frame = 0;                     // the frame the next piece goes into
    uint64_t filled = 0;                  // bytes of it already there
    uint64_t next = 0;                    // the index of the next part
    double last_s = 0;
  };
  std::map<std::string, Unfinished> open_;
};

}  // namespace swarm::wire
