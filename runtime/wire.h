// wire.h: swarm wire protocol v2 over ZeroMQ multipart messages (docs/protocol.md).
//
// A message is: frame 0, the envelope, a msgpack array [magic "SWRM", version, type, id,
// attempt]; frame 1, the body, a msgpack map; frames 2.., raw tensor payloads, each described
// in body["tensors"][i] by dtype, shape, codec, byte length and XXH3-64 checksum.
//
// Defines swarm::wire::Message (envelope + msgpack body bytes + tensors), `encode` (Message ->
// frames), `decode` (frames -> Message, validating every limit of runtime/limits.h before it
// allocates, throwing WireError), `peek_envelope` (the envelope alone, before anything else is
// parsed) and `send`/`recv_frames` over a zmq socket. A body is read into a typed struct with
// runtime/messages.h; body_json/json_message are for the few places that want JSON (clients,
// logs, tests). Tensor payloads are zmq::message_t, so a payload is forwarded without copying
// (zmq_msg_copy shares the buffer).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "runtime/codec_spec.h"
#include "runtime/errors.h"
#include "runtime/shape.h"

namespace swarm::wire {

constexpr const char* kMagic = "SWRM";
// v2: routing ids travel as msgpack bin (v1 sent them as str, which is not valid UTF-8 for
// ZeroMQ's generated ids). An ERROR bad_version is written in a v1 envelope, and every version
// decodes an ERROR in a v1 envelope, so a peer of any version can read why it was refused.
constexpr int kVersion = 2;
constexpr int kVersionForRefusals = 1;

enum class MsgType : int {
  // Session (both directions).
  kHello = 1,       // first message of every session: {role, version, peer fields...}
  kWelcome = 2,     // router -> HELLO sender: {peer_id, heartbeat_ms, liveness}
  kHeartbeat = 3,   // peer -> router: {stage, ready, queue, ms_per_unit...}; router -> peer: liveness
  kBye = 4,         // either side: clean goodbye
  kError = 5,       // {code, name, message}; id/attempt echo the offending request
  kPart = 6,        // one piece of a larger message, on router connections (id: its index; runtime/parts.h)
  // Router -> stage server.
  kLoadStage = 10,  // {job_id, stage, spec}; reply kStageReady
  kStageReady = 11, // {job_id, stage, params, fwd_ms, hash}
  kForward = 20,    // tensors [input]; reply kResult tensors [output]
  kForwardLoss = 21,// last stage: tensors [input, targets]; reply kResult {loss} tensors [grad_input?]
  kBackward = 22,   // tensors [input, grad_output]; reply kResult tensors [grad_input?]
  kEval = 23,       // forward only; last stage: tensors [input, targets] -> {loss}; else [output]
  kResult = 24,     // reply to 20..23 and 25: {mb, stage, samples, compute_ms, loss?, cached?}
  kStep = 25,       // sync schedule: take an optimizer step now; reply kResult
  kRoundBegin = 30, // {round, stage, what, fragment, fragments}: send your outer gradient; reply kRoundDelta
  kRoundDelta = 31, // {round, stage, what}; tensors [delta or gradient sum]
  kRoundApply = 32, // {round, what, samples...}; tensors [group mean or sum] -> apply; reply kRoundDone
  kRoundDone = 33,  // {round, stage, hash}
  kStateRequest = 34, // router -> donor: send theta_g and outer momentum; reply kStateReply
  kStateReply = 35,   // tensors [theta_g, momentum (, theta, adam_m, adam_v)]
  kStateLoad = 36,    // router -> joiner: the same tensors; reply kRoundDone
  kRoundReduce = 37,  // router -> the round's reducer: {weights}; tensors [every member's outer gradient]
  kRoundReduced = 38, // reducer -> router: tensors [the group's mean or sum]
  // Peer to peer (docs/protocol.md, "Peer to peer"); FETCH also router -> holder (the relay).
  kFetch = 40,      // {key, part}: the tensor a TensorRef names; reply kFetched tensors [it] or kError not_held
  kFetched = 41,
  kRelease = 42,    // router -> holder {keys}: the replies of these requests are no longer needed
  kPeerKeys = 43,   // router -> stage {add, remove}: the public keys other stage servers fetch with (CURVE)
  kPush = 44,       // router -> holder {key, part, to, to_key?}: send that tensor to `to` now, as an unasked FETCHED
  // Client (CLI) -> router.
  kSubmit = 50,     // {spec, resume?} or {bench_transport}; reply kSubmitted {job_id} or kError
  kSubmitted = 51,
  kStatus = 52,     // {job_id?}; reply kStatusReply {...}
  kStatusReply = 53,
  kCancel = 54,     // {job_id}; reply kStatusReply
  kPeers = 55,      // {offset?, limit?}; reply kPeersReply {peers: [...], total, offset}
  kPeersReply = 56,
  kChaos = 57,      // client -> router {peer, fault}: inject a fault into a live peer; the router
                    // checks the spec, forwards {fault} to the peer and replies kChaosReply {peer}
  kChaosReply = 58,
};
const char* msg_type_name(MsgType t);
bool known_type(int t);
// How many tensor frames a message of type t may carry, and how large its body frame may be:
// checked by `decode` before anything of the message is parsed or unpacked.
size_t max_tensors(MsgType t);
size_t max_body_bytes(MsgType t);

enum class DType : int { kF32 = 0, kI32 = 1, kU16 = 2 };
const char* dtype_name(DType d);
size_t dtype_bytes(DType d);

// What a tensor frame holds. Float tensors (kF32) travel through a codec; integer tensors
// (tokens) travel raw with codec "raw".
struct TensorDesc {
  DType dtype = DType::kF32;
  Shape shape;                    // inline (runtime/shape.h): a description copies without a malloc
  compression::CodecSpec codec;   // ignored for integer dtypes
  uint64_t nbytes = 0;            // the codec's encoded bytes (encoded_bytes of the codec and shape)
  uint64_t checksum = 0;          // XXH3-64 of the payload bytes, seed 0
  // Codec with entropy=zstd: the size of the zstd frame that carries the payload on the wire
  // (set by compress, and by decode from what arrived). Otherwise 0.
  uint64_t zbytes = 0;
  int64_t numel() const;
  uint64_t wire_bytes() const { return zbytes ? zbytes : nbytes; }   // what the payload costs on the wire
};

// A tensor that travels peer to peer: its description, and who holds its bytes. In a request
// the receiver fetches it (FETCH {key, part} to `from`) before it acts on the message; in a
// reply `from` is empty: the sender holds it, because the request asked it to (`hold`).
struct TensorRef {
  uint32_t slot = 0;   // its position among the message's tensors once fetched
  std::string from;    // the holder's peer address (tcp://host:port); empty: the sender
  std::string from_key;  // the holder's public key (Z85) when the swarm uses CURVE; empty otherwise
  uint64_t key = 0;    // the id of the request whose reply made it
  uint32_t part = 0;   // its index among that reply's tensors
  TensorDesc desc;     // what the fetched tensor must be, checksum included
  bool pushed = false; // the router asked the holder to push it here: wait a while for it before fetching
};
constexpr size_t kMaxAddressBytes = 255;

struct Tensor {
  TensorDesc desc;
  zmq::message_t data;            // desc.nbytes bytes; the zstd frame of them (desc.zbytes bytes) when packed
  bool packed = false;
};

struct Message {
  MsgType type = MsgType::kHeartbeat;
  int version = kVersion;   // the envelope's; kVersionForRefusals only for an ERROR bad_version
  uint64_t id = 0;        // request id, echoed by its reply
  uint32_t attempt = 0;   // attempt number of the request, echoed by its reply
  // The body: one msgpack map with string keys, without the "tensors" descriptions (the wire
  // layer adds and removes them). Empty means the empty map. Read it with runtime/messages.h.
  std::string body;
  std::vector<Tensor> tensors;
  // Tensors held elsewhere (docs/protocol.md, "Peer to peer"): together with `tensors` at most
  // max_tensors(type); their slots and the tensors' positions fill 0..n-1.
  std::vector<TensorRef> refs;
  // A request's reply keeps its tensors at the replier and carries references instead.
  bool hold = false;
  // With refs: a reference not fetched in this long [ms] is answered `unreachable`, before the
  // sender stops waiting for the reply (0: the receiver's own --fetch-timeout-s).
  uint32_t fetch_within_ms = 0;

  Message() = default;
  Message(MsgType t, uint64_t id_ = 0, uint32_t attempt_ = 0, std::string body_ = {})
      : type(t), id(id_), attempt(attempt_), body(std::move(body_)) {}
  // Bodies are msgpack (runtime/messages.h, or json_message for JSON): never a JSON object by accident.
  Message(MsgType, uint64_t, uint32_t, const nlohmann::json&) = delete;
  Message(Message&&) = default;
  Message& operator=(Message&&) = default;
};

// A message whose body is a JSON object (clients; tests), and a body read back as JSON (with
// the decoder's limits on nesting and sizes; throws WireError).
Message json_message(MsgType t, uint64_t id, uint32_t attempt, const nlohmann::json& body);
nlohmann::json body_json(const Message& m);

uint64_t checksum(const void* data, size_t n);
// checksum() of n zero bytes, without n bytes to read (for payloads that are all zeros).
uint64_t zeros_checksum(size_t n);

// A tensor frame for `n` bytes to be filled by the caller; call `seal` after filling.
Tensor make_tensor(DType dtype, Shape shape, const compression::CodecSpec& codec,
                   size_t nbytes);
// The same, its buffer taken from a process-wide pool of freed buffers of that size and given
// back to it when the last share of the frame is closed (by whichever thread: ZeroMQ's I/O
// thread after a send). For frames made over and over at one size: the router's token tensors,
// two a microbatch, where a fresh 32 KB malloc made glibc consolidate its fast bins each time.
Tensor make_pooled_tensor(DType dtype, Shape shape, const compression::CodecSpec& codec,
                          size_t nbytes);
void seal(Tensor& t);   // computes the checksum
// The tensors in slot order, once every reference has been fetched: `fetched[i]` is the
// tensor of m.refs[i]. Throws WireError(kBadTensor) naming the slot when a fetched tensor is not
// the one its reference describes (dtype, shape, codec, byte count, checksum).
void resolve(Message& m, std::vector<Tensor> fetched);
// Whether two descriptions name the same bytes.
bool same_tensor(const TensorDesc& a, const TensorDesc& b);

// A shared (zero-copy) copy of a tensor frame: the payload buffer is reference counted.
Tensor share(Tensor& t);
// Packs the payload into a zstd frame when the codec asks for it (entropy=zstd) and it is not
// packed yet; `encode` does this for every tensor it sends. A tensor sent to several peers is
// best compressed once, before it is shared. `decode` unpacks, so receivers see the codec's bytes.
void compress(Tensor& t);
// The reverse, for a packed tensor used where it was made (throws WireError on a bad frame).
void decompress(Tensor& t);

// The envelope of a message, parsed alone: a receiver decides from it whether to parse the rest
// (the router takes nothing but HELLO from a routing id it does not know). Throws WireError.
struct Envelope {
  MsgType type = MsgType::kHeartbeat;
  int version = kVersion;
  uint64_t id = 0;
  uint32_t attempt = 0;
};
Envelope peek_envelope(const std::vector<zmq::message_t>& frames);

// A routing id in a JSON body that becomes msgpack (PEERS_REPLY): msgpack bin, as every id on the wire.
inline nlohmann::json id_json(const std::string& id) { return nlohmann::json::binary(std::vector<uint8_t>(id.begin(), id.end())); }
// The bytes of an id read back from such a body (bin, or str from a v1-style writer).
inline std::string id_from_json(const nlohmann::json& j) {
  if (j.is_binary()) return std::string(j.get_binary().begin(), j.get_binary().end());
  return j.is_string() ? j.get<std::string>() : std::string();
}
// The reverse of printable_id for "0x" + hex (an id that is not printable); nullopt for other text.
std::optional<std::string> id_from_hex(const std::string& text);
// A routing id as a person reads it: itself when it is printable ASCII, else "0x" + hex.
std::string printable_id(const std::string& id);
// The version an envelope claims, when frame 0 is at least [magic, version, ...]; else nullopt.
std::optional<int> peek_version(const std::vector<zmq::message_t>& frames);

// Frames -> Message. Validates magic, version, type, frame counts, sizes against limits (the
// sum of every tensor's declared size too, before any is unpacked), every tensor description
// against its frame and codec, and checksums (when verify is true). Throws WireError; never
// crashes on any input.
Message decode(std::vector<zmq::message_t>& frames, bool verify_checksums = true);
// The request id of a message that failed to decode, when at least its envelope is sound
// (e.g. a tensor frame failed its checksum): the router re-sends that request at once.
std::optional<uint64_t> peek_id(const std::vector<zmq::message_t>& frames);
// Message -> frames (moves the tensor payloads out of `m`).
std::vector<zmq::message_t> encode(Message& m);

// Receives one multipart message. With a ROUTER socket the first frame is the sender's
// routing id, returned in `route`. Returns nullopt when nothing arrived (non-blocking sockets
// or timeouts). The frames are consumed either way.
struct Received {
  std::string route;
  std::vector<zmq::message_t> frames;
};
std::optional<Received> recv_frames(zmq::socket_t& s, bool with_route, zmq::recv_flags flags);
// Sends m (prefixing the routing id when `route` is non-null). Returns false when the peer is
// unreachable (ROUTER_MANDATORY) or the send would block.
bool send(zmq::socket_t& s, Message& m, const std::string* route = nullptr);
// Sends already encoded frames the same way.
bool send_frames(zmq::socket_t& s, std::vector<zmq::message_t>& frames, const std::string* route = nullptr);

}  // namespace swarm::wire
