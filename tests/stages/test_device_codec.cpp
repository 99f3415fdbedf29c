// test_device_codec.cpp: stages/device_codec.h. On the CPU encode_output and decode_input are
// to_wire and from_wire exactly. On a CUDA device in a -DSWARM_CUDA=ON build the int8/int4 path
// writes the very bytes the CPU codec writes and decodes to the very floats (skipped elsewhere).
#include <cstring>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "stages/device_codec.h"
#include "stages/tensor_codec.h"

namespace swarm {
namespace {

bool same_bytes(const wire::Tensor& a, const wire::Tensor& b) {
  return a.desc.nbytes == b.desc.nbytes && a.desc.checksum == b.desc.checksum && a.data.size() == b.data.size() &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size()) == 0;
}

torch::Tensor activations() {
  torch::manual_seed(5);
  torch::Tensor x = torch::randn({3, 17, 40});
  x.index_put_({0, 0, 0}, 300.0f);  // an outlier in the first block
  return x;
}

TEST(DeviceCodec, OnTheCpuItIsTheCpuCodec) {
  const torch::Tensor x = activations();
  for (const char* name : {"fp32", "bf16", "int8:block=64", "int4:block=64,scale=fp16"}) {
    const compression::CodecSpec c = compression::parse_codec(name);
    wire::Tensor a = encode_output(x, c), b = to_wire(x, c);
    EXPECT_TRUE(same_bytes(a, b)) << name;
    EXPECT_TRUE(torch::equal(decode_input(a, 3, 40, torch::kCPU), from_wire(b, 3, 40))) << name;
  }
}

TEST(DeviceCodec, CudaBytesEqualTheCpuCodecs) {
  if (!device_codecs_available() || !torch::cuda::is_available()) GTEST_SKIP() << "needs a -DSWARM_CUDA=ON build and a CUDA device";
  const torch::Tensor x = activations();
  const torch::Tensor xd = x.to(torch::kCUDA);
  for (const char* name : {"int8:block=64", "int8:block=1024,scale=fp16", "int4:block=64", "int8:block=64,entropy=zstd"}) {
    const compression::CodecSpec c = compression::parse_codec(name);
    wire::Tensor dev = encode_output(xd, c), cpu = to_wire(x, c);
    EXPECT_TRUE(same_bytes(dev, cpu)) << name;
    const torch::Tensor back = decode_input(dev, 3, 40, torch::Device("cuda:0"));
    EXPECT_TRUE(back.is_cuda());
    EXPECT_TRUE(torch::equal(back.cpu(), from_wire(cpu, 3, 40))) << name;
  }
  // A malformed encoding is a bad tensor on the device path too.
  wire::Tensor bad = to_wire(x, compression::parse_codec("int8:block=64"));
  static_cast<uint8_t*>(bad.data.data())[3] |= 0x80;  // a negative scale
  EXPECT_THROW(decode_input(bad, 3, 40, torch::Device("cuda:0")), WireError);
}

}  // namespace
}  // namespace swarm
