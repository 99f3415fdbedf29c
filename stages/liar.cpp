// liar.cpp: implements stages/liar.h.
#include "stages/liar.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/messages.h"

namespace swarm {

namespace {

// Multiplies an fp32-coded tensor's values by `factor` (or sets them to `set` when factor is 0;
// with `peak`, scales them so that the largest is `peak`) and seals it again, so that it passes
// the transport's checksum.
bool scale(wire::Tensor& t, float factor, float set = 0, float peak = 0) {
  if (t.packed || t.desc.dtype != wire::DType::kF32 || t.desc.codec.codec != compression::Codec::kFp32) return false;
  const size_t n = t.data.size() / sizeof(float);
  auto* v = static_cast<float*>(t.data.data());
  if (peak > 0) {
    float m = 0;
    for (size_t i = 0; i < n; ++i) m = std::max(m, std::abs(v[i]));
    factor = m > 0 ? peak / m : 1.f;
  }
  for (size_t i = 0; i < n; ++i) v[i] = factor != 0 ? v[i] * factor : set;
  wire::seal(t);
  return true;
}

}  // namespace

bool lie_about(wire::Message& m) {
  switch (m.type) {
    case wire::MsgType::kStageReady: {
      msg::StageReady r = msg::read<msg::StageReady>(m);
      r.params += 1;
      m.body = msg::pack(r);
      return true;
    }
    case wire::MsgType::kResult:
      return !m.tensors.empty() && scale(m.tensors[0], 1.f, 0, 1e7f);
    case wire::MsgType::kRoundDelta: {
      msg::RoundDelta d = msg::read<msg::RoundDelta>(m);
      d.samples = int64_t(1e15);
      m.body = msg::pack(d);
      for (wire::Tensor& t : m.tensors) scale(t, 1e6f);
      return true;
    }
    case wire::MsgType::kRoundDone: {
      msg::RoundDone d = msg::read<msg::RoundDone>(m);
      d.hash ^= 0x5bd1e995u;
      m.body = msg::pack(d);
      return true;
    }
    case wire::MsgType::kStateReply:
      return m.tensors.size() == 5 && scale(m.tensors[4], 0, -1.f);
    default:
      return false;
  }
}

}  // namespace swarm
