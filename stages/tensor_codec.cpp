// tensor_codec.cpp: torch tensors <-> wire frames (see tensor_codec.h).
#include "stages/tensor_codec.h"

#include <cstring>

#include "compression/codec.h"

namespace swarm {

wire::Tensor to_wire(const torch::Tensor& in, const compression::CodecSpec& codec) {
  torch::Tensor t = in.detach().to(torch::kCPU);
  const wire::Shape shape(t.sizes().begin(), t.sizes().end());
  wire::Tensor w;
  if (t.is_floating_point()) {
    t = t.to(torch::kFloat32).contiguous();
    const int64_t n = t.numel();
    w = wire::make_tensor(wire::DType::kF32, shape, codec, compression::encoded_bytes(codec, n));
    compression::encode(codec, t.data_ptr<float>(), n, static_cast<uint8_t*>(w.data.data()));
  } else {
    t = t.to(torch::kInt32).contiguous();
    const size_t nbytes = size_t(t.numel()) * sizeof(int32_t);
    w = wire::make_tensor(wire::DType::kI32, shape, compression::CodecSpec{}, nbytes);
    if (nbytes) std::memcpy(w.data.data(), t.data_ptr<int32_t>(), nbytes);
  }
  wire::seal(w);
  return w;
}

void check_frame_shape(const wire::Tensor& w, int expect_rank, int64_t expect_last_dim) {
  const auto& d = w.desc;
  if (expect_rank >= 0 && int(d.shape.size()) != expect_rank)
    throw WireError(WireErrc::kBadTensor, "expected a rank-" + std::to_string(expect_rank) + " tensor, got rank " +
                                              std::to_string(d.shape.size()));
  if (expect_last_dim > 0 && (d.shape.empty() || d.shape.back() != expect_last_dim))
    throw WireError(WireErrc::kBadTensor, "expected last dimension " + std::to_string(expect_last_dim));
}

torch::Tensor from_wire(const wire::Tensor& w, int expect_rank, int64_t expect_last_dim) {
  const auto& d = w.desc;
  check_frame_shape(w, expect_rank, expect_last_dim);
  const int64_t n = d.numel();
  switch (d.dtype) {
    case wire::DType::kF32: {
      torch::Tensor t = torch::empty(sizes_of(d.shape), torch::kFloat32);
      try {
        compression::decode(d.codec, static_cast<const uint8_t*>(w.data.data()), w.data.size(), n, t.data_ptr<float>());
      } catch (const CodecError& e) {
        throw WireError(WireErrc::kBadTensor, e.what());
      }
      return t;
    }
    case wire::DType::kI32: {
      torch::Tensor t = torch::empty(sizes_of(d.shape), torch::kInt32);
      if (n) std::memcpy(t.data_ptr<int32_t>(), w.data.data(), size_t(n) * 4);
      return t.to(torch::kInt64);
    }
    case wire::DType::kU16: {
      torch::Tensor t = torch::empty(sizes_of(d.shape), torch::kInt64);
      const auto* src = static_cast<const uint8_t*>(w.data.data());
      int64_t* dst = t.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = int64_t(src[2 * i]) | (int64_t(src[2 * i + 1]) << 8);
      return t;
    }
  }
  throw WireError(WireErrc::kBadTensor, "unknown dtype");
}

}  // namespace swarm
