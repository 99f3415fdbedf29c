// errors.h: the two kinds of error in swarm.
//
// Bad input (a malformed frame from the network, a job spec with 7 layers over 4 stages, a
// corrupt encoded tensor) is expected: it is thrown as a typed `swarm::InputError` subclass
// with a message a person can act on, caught at the boundary, and the offender dropped.
// A broken internal invariant is a bug: `SWARM_CHECK` throws `swarm::InternalError` with the
// file and line. Header-only, so every library (compression too) can use it.
#pragma once

#include <stdexcept>
#include <string>

namespace swarm {

// Base for every error that bad input can cause.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A message from the network that does not follow the protocol (see docs/protocol.md).
// `code` is one of the WireErrc values; it travels back to the sender in an ERROR message.
enum class WireErrc : int {
  kMalformed = 1,      // cannot be parsed (bad msgpack, missing field, wrong type)
  kBadMagic = 2,       // first frame is not a swarm envelope
  kBadVersion = 3,     // protocol version we do not speak
  kTooLarge = 4,       // over a limit in runtime/limits.h
  kTruncated = 5,      // fewer frames or bytes than the body declares
  kOutOfOrder = 6,     // valid message at the wrong time (e.g. before HELLO)
  kChecksum = 7,       // a tensor frame's checksum does not match
  kBadTensor = 8,      // tensor description inconsistent (dtype, shape, codec, byte count)
  kUnknownType = 9,    // message type we do not know
  kUnreachable = 10,   // a tensor reference could not be fetched from its holder (docs/protocol.md)
  kNotHeld = 11,       // FETCH of a tensor its holder does not hold (released, expired, never made)
  kForbidden = 12,     // the sender's key lacks the role this needs (docs/security.md)
};
inline const char* wire_errc_name(WireErrc code) {
  switch (code) {
    case WireErrc::kMalformed: return "malformed";
    case WireErrc::kBadMagic: return "bad_magic";
    case WireErrc::kBadVersion: return "bad_version";
    case WireErrc::kTooLarge: return "too_large";
    case WireErrc::kTruncated: return "truncated";
    case WireErrc::kOutOfOrder: return "out_of_order";
    case WireErrc::kChecksum: return "checksum";
    case WireErrc::kBadTensor: return "bad_tensor";
    case WireErrc::kUnknownType: return "unknown_type";
    case WireErrc::kUnreachable: return "unreachable";
    case WireErrc::kNotHeld: return "not_held";
    case WireErrc::kForbidden: return "forbidden";
  }
  return "unknown";
}

class WireError : public InputError {
 public:
  WireError(WireErrc code, const std::string& what) : InputError(what), code_(code) {}
  WireErrc code() const { return code_; }

 private:
  WireErrc code_;
};

// A job spec a person wrote wrong; the message says what to change.
class SpecError : public InputError {
 public:
  using InputError::InputError;
};

// An encoded tensor that does not decode (wrong byte count, block size, codec parameters).
class CodecError : public InputError {
 public:
  using InputError::InputError;
};

// A bug: an invariant of our own code does not hold.
class InternalError : public std::logic_error {
 public:
  InternalError(const char* file, int line, const std::string& what)
      : std::logic_error(std::string(file) + ":" + std::to_string(line) + ": " + what) {}
};

}  // namespace swarm

#define SWARM_CHECK(cond, msg)                                                \
  do {                                                                        \
    if (!(cond)) throw ::swarm::InternalError(__FILE__, __LINE__,             \
                                              std::string("check failed: ") + \
                                                  #cond + ": " + (msg));      \
  } while (0)
