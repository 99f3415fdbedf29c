// device_codec.cpp: encode_output and decode_input (see device_codec.h). The CUDA path is
// compiled only with -DSWARM_CUDA=ON against a CUDA libtorch; elsewhere both go through the CPU.
#include "stages/device_codec.h"

#include <cstring>

#include "stages/tensor_codec.h"

#ifdef SWARM_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "compression/cuda/codec_cuda.h"
#endif

namespace swarm {

#ifdef SWARM_CUDA
namespace {

bool quantized(const compression::CodecSpec& c) {
  return c.codec == compression::Codec::kInt8 || c.codec == compression::Codec::kInt4;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("device codec: ") + what + ": " + cudaGetErrorString(e));
}

// A pinned (page-locked) host buffer, grown on demand and reused: copies from and to it run at
// full PCIe speed and asynchronously. One per direction and thread (the compute thread).
class PinnedBuffer {
 public:
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  uint8_t* get(size_t bytes) {
    if (bytes > n_) {
      if (p_) cudaFreeHost(p_);
      p_ = nullptr;
      n_ = 0;
      cuda_ok(cudaMallocHost(&p_, bytes), "cudaMallocHost");
      n_ = bytes;
    }
    return static_cast<uint8_t*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};
thread_local PinnedBuffer g_down, g_up;

// The codec's stream: one from libtorch's pool per device, distinct from the compute stream.
c10::cuda::CUDAStream codec_stream(c10::DeviceIndex index) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
}

wire::Tensor encode_on_device(const torch::Tensor& in, const compression::CodecSpec& codec) {
  const c10::DeviceIndex index = in.device().index();
  c10::cuda::CUDAGuard guard(in.device());
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(index);
  const c10::cuda::CUDAStream side = codec_stream(index);
  const torch::Tensor x = in.detach().to(torch::kFloat32).contiguous();  // queued on the compute stream
  const int64_t n = x.numel();
  const size_t nbytes = compression::encoded_bytes(codec, n);
  at::cuda::CUDAEvent produced;
  produced.record(compute);
  produced.block(side);       // the codec stream waits for x, the compute stream goes on
  x.record_stream(side);      // x's memory is not reused before the codec stream is done with it
  torch::Tensor encoded;
  {
    c10::cuda::CUDAStreamGuard on_side(side);  // allocated for (and freed after) the codec stream
    encoded = torch::empty({int64_t(nbytes)}, x.options().dtype(torch::kUInt8));
  }
  const wire::Shape shape(in.sizes().begin(), in.sizes().end());
  wire::Tensor w = wire::make_tensor(wire::DType::kF32, shape, codec, nbytes);
  if (n > 0) {
    compression::cuda::encode(codec, x.data_ptr<float>(), n, encoded.data_ptr<uint8_t>(), side.stream());
    uint8_t* host = g_down.get(nbytes);
    cuda_ok(cudaMemcpyAsync(host, encoded.data_ptr<uint8_t>(), nbytes, cudaMemcpyDeviceToHost, side.stream()),
            "copy to host");
    cuda_ok(cudaStreamSynchronize(side.stream()), "codec stream");
    std::memcpy(w.data.data(), host, nbytes);
  }
  wire::seal(w);
  return w;
}

torch::Tensor decode_on_device(const wire::Tensor& w, const torch::Device& device) {
  const c10::DeviceIndex index = device.index() < 0 ? c10::DeviceIndex(0) : device.index();
  const torch::Device dev(torch::kCUDA, index);
  c10::cuda::CUDAGuard guard(dev);
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(index);
  const c10::cuda::CUDAStream side = codec_stream(index);
  const compression::CodecSpec& codec = w.desc.codec;
  const int64_t n = w.desc.numel();
  const size_t nbytes = w.data.size();  // the codec's bytes: the wire layer has unpacked any zstd
  torch::Tensor encoded, out;
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    encoded = torch::empty({int64_t(nbytes)}, torch::TensorOptions().dtype(torch::kUInt8).device(dev));
    out = torch::empty(sizes_of(w.desc.shape), torch::TensorOptions().dtype(torch::kFloat32).device(dev));
  }
  if (n > 0) {
    uint8_t* host = g_up.get(nbytes);
    std::memcpy(host, w.data.data(), nbytes);
    cuda_ok(cudaMemcpyAsync(encoded.data_ptr<uint8_t>(), host, nbytes, cudaMemcpyHostToDevice, side.stream()),
            "copy to device");
    try {
      // Checks the content as the CPU decoder does; synchronises the codec stream once.
      compression::cuda::decode(codec, encoded.data_ptr<uint8_t>(), nbytes, n, out.data_ptr<float>(), side.stream());
    } catch (const CodecError& e) {
      throw WireError(WireErrc::kBadTensor, e.what());
    }
  }
  out.record_stream(compute);  // made on the codec stream, used on the compute stream
  at::cuda::CUDAEvent decoded;
  decoded.record(side);
  decoded.block(compute);
  return out;
}

}  // namespace

bool device_codecs_available() { return true; }

wire::Tensor encode_output(const torch::Tensor& t, const compression::CodecSpec& codec) {
  if (t.is_cuda() && t.is_floating_point() && quantized(codec)) return encode_on_device(t, codec);
  return to_wire(t, codec);
}

torch::Tensor decode_input(const wire::Tensor& w, int expect_rank, int64_t expect_last_dim, const torch::Device& device) {
  if (device.is_cuda() && w.desc.dtype == wire::DType::kF32 && quantized(w.desc.codec)) {
    check_frame_shape(w, expect_rank, expect_last_dim);
    return decode_on_device(w, device);
  }
  return from_wire(w, expect_rank, expect_last_dim).to(device);
}

#else  // a build without -DSWARM_CUDA=ON: the CPU does every codec

bool device_codecs_available() { return false; }

wire::Tensor encode_output(const torch::Tensor& t, const compression::CodecSpec& codec) { return to_wire(t, codec); }

torch::Tensor decode_input(const wire::Tensor& w, int expect_rank, int64_t expect_last_dim, const torch::Device& device) {
  return from_wire(w, expect_rank, expect_last_dim).to(device);
}

#endif

}  // namespace swarm
