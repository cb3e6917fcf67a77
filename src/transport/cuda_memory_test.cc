// GPU memory through the transport (MEMBOX_WITH_CUDA builds; needs a CUDA
// GPU and a UCX built with CUDA, e.g. PyPI's libucx-cu13): a cudaMalloc'd
// buffer registered as MemoryType::kCuda is written and read by a peer with
// one-sided RMA, and refused by membox's TCP path. Skips without a GPU or
// without CUDA in UCX (channel_test covers the refusal there).
#include <cstring>
#include <numeric>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "membox/transport/channel.h"
#include "membox/transport/device.h"

#include "tests/support/testing.h"

namespace membox::transport {
namespace {

using namespace std::chrono_literals;

using Pair = test_support::DevicePair;

Pair Connect(const char* transports, ProtocolChoice protocol) {
  DeviceOptions so;
  so.transports = transports;
  so.protocol = protocol;
  so.name = "gpu-owner";
  DeviceOptions co = so;
  co.name = "peer";
  auto p = test_support::ConnectDevices(so, co);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? std::move(*p) : Pair{};
}

class CudaMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no CUDA device";
    }
    ASSERT_EQ(cudaMalloc(&gpu_, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(gpu_, 0, kBytes), cudaSuccess);
  }
  void TearDown() override {
    if (gpu_) cudaFree(gpu_);
  }
  static constexpr size_t kBytes = 8 << 20;
  void* gpu_ = nullptr;
};

TEST_F(CudaMemoryTest, PeerWritesAndReadsGpuMemoryWithRma) {
  Pair p = Connect("auto", ProtocolChoice::kRma);
  ASSERT_NE(p.to_server, nullptr);
  if (!p.server->SupportsMemoryType(MemoryType::kCuda)) {
    GTEST_SKIP() << "this UCX has no CUDA support";
  }
  auto gpu = p.server->RegisterMemRegion(gpu_, kBytes, MemoryType::kCuda);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  EXPECT_EQ((*gpu)->memory_type(), MemoryType::kCuda);
  auto remote = p.to_server->Import((*gpu)->Export());
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  EXPECT_EQ((*remote)->mapped(), nullptr);

  auto local = p.client->AllocateMemRegion(kBytes);
  ASSERT_TRUE(local.ok());
  auto* src = static_cast<uint8_t*>((*local)->data());
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 13 + 1);
  auto w =
      p.to_server->Write(src, **local, (*remote)->address(), **remote, kBytes);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(w->Wait(30s).ok());
  ASSERT_TRUE(p.to_server->Flush()->Wait(30s).ok());
  std::vector<uint8_t> check(kBytes);
  ASSERT_EQ(cudaMemcpy(check.data(), gpu_, kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(check.data(), src, kBytes), 0);

  // Changed on the GPU, read back by the peer.
  ASSERT_EQ(cudaMemset(gpu_, 0x5a, kBytes / 2), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> back(kBytes);
  auto reg = p.client->RegisterMemRegion(back.data(), kBytes);
  ASSERT_TRUE(reg.ok());
  auto r = p.to_server->Read(back.data(), **reg, (*remote)->address(), **remote,
                             kBytes);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->Wait(30s).ok());
  for (size_t i = 0; i < kBytes; ++i) {
    uint8_t want = i < kBytes / 2 ? 0x5a : src[i];
    ASSERT_EQ(back[i], want) << "byte " << i;
  }
}

TEST_F(CudaMemoryTest, TcpPathRefusesGpuMemory) {
  Pair p = Connect("tcp", ProtocolChoice::kAuto);
  ASSERT_NE(p.to_server, nullptr);
  if (!p.server->SupportsMemoryType(MemoryType::kCuda)) {
    GTEST_SKIP() << "this UCX has no CUDA support";
  }
  auto gpu = p.server->RegisterMemRegion(gpu_, kBytes, MemoryType::kCuda);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  // The owner refuses the import: its TCP reader cannot recv() into GPU
  // memory.
  auto remote = p.to_server->Import((*gpu)->Export());
  ASSERT_FALSE(remote.ok());
  EXPECT_EQ(remote.status().code(), StatusCode::kFailedPrecondition)
      << remote.status().ToString();
  // And a local GPU region cannot be the source of a TCP write.
  auto local_gpu = p.client->RegisterMemRegion(gpu_, kBytes, MemoryType::kCuda);
  ASSERT_TRUE(local_gpu.ok());
  auto host = p.server->AllocateMemRegion(4096);
  auto host_remote = p.to_server->Import((*host)->Export());
  ASSERT_TRUE(host_remote.ok()) << host_remote.status().ToString();
  auto w = p.to_server->Write(gpu_, **local_gpu, (*host_remote)->address(),
                              **host_remote, 4096);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace membox::transport
