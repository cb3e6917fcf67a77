// A round's local sum alone: pushes in memory (one fused pass that also
// fills the outputs), pushes read on demand (one at a time through
// staging), none at all, averaging, and failures that stop it.
#include "src/ps/local_sum.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

using transport::MemRegion;
using transport::RegionDescriptor;

class PlainRegion final : public MemRegion {
 public:
  PlainRegion(void* data, size_t size)
      : MemRegion(data, size, 1, /*device_allocated=*/false) {}
  RegionDescriptor Export() const override { return {}; }
  Result<RegionDescriptor> ExportRange(uint64_t, uint64_t) override {
    return UnimplementedError("plain");
  }
  void RevokeRange(uint64_t) override {}
};

constexpr size_t kN = 1000;  // floats
constexpr uint64_t kBytes = kN * sizeof(float);

std::vector<float> Filled(float base) {
  std::vector<float> v(kN);
  for (size_t i = 0; i < kN; ++i) v[i] = base + float(i % 7);
  return v;
}

struct Fixture {
  SyncCores cores{2};
  std::vector<float> dst = std::vector<float>(kN, -1.0f);
  PlainRegion dst_region{dst.data(), kBytes};
  std::vector<float> staging_mem = std::vector<float>(kN);
  PlainRegion staging_region{staging_mem.data(), kBytes};
  int staged = 0;
  std::function<Result<MemRegion*>(uint64_t)> staging =
      [this](uint64_t n) -> Result<MemRegion*> {
    ++staged;
    if (n > kBytes) return ResourceExhaustedError("staging");
    return &staging_region;
  };
  Result<LocalSumDone> Sum(std::span<const PushInput> in, double scale = 1.0) {
    return SumPushes(cores, DType::kFloat32,
                     reinterpret_cast<uint8_t*>(dst.data()), dst_region, kBytes,
                     in, scale, staging);
  }
};

TEST(LocalSumTest, PushesInMemoryAreSummedInOnePassWithTheOutputs) {
  Fixture f;
  auto a = Filled(1), b = Filled(10), c = Filled(100);
  std::vector<float> out_a(kN), out_c(kN);
  std::vector<PushInput> in(3);
  in[0].data = a.data();
  in[0].output = out_a.data();
  in[1].data = b.data();
  in[2].data = c.data();
  in[2].output = out_c.data();
  auto done = f.Sum(in);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_TRUE(done->outputs_written);
  EXPECT_EQ(done->outputs, 2u);
  EXPECT_EQ(f.staged, 0);
  for (size_t i = 0; i < kN; i += 37) {
    const float want = 111 + 3 * float(i % 7);
    ASSERT_EQ(f.dst[i], want) << i;
    ASSERT_EQ(out_a[i], want) << i;
    ASSERT_EQ(out_c[i], want) << i;
  }
}

TEST(LocalSumTest, PushesReadOnDemandGoThroughStagingOneAtATime) {
  Fixture f;
  auto a = Filled(1), b = Filled(10), c = Filled(100);
  std::vector<float> out(kN, 0.0f);
  int reads = 0;
  auto reader = [&reads](const std::vector<float>& v) {
    return [&reads, &v](uint8_t* into, const MemRegion&) {
      ++reads;
      std::memcpy(into, v.data(), kBytes);
      return Result<const uint8_t*>(into);
    };
  };
  std::vector<PushInput> in(3);
  in[0].read = reader(a);  // read straight into dst
  in[1].data = b.data();   // mapped: added from where it is
  in[2].read = reader(c);  // read into staging, then added
  in[2].output = out.data();
  auto done = f.Sum(in, 0.5);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_FALSE(done->outputs_written) << "outputs go out after the sum";
  EXPECT_EQ(out[3], 0.0f);
  EXPECT_EQ(reads, 2);
  EXPECT_EQ(f.staged, 2);  // every push after the first
  for (size_t i = 0; i < kN; i += 37) {
    ASSERT_EQ(f.dst[i], 0.5f * (111 + 3 * float(i % 7))) << i;
  }
}

TEST(LocalSumTest, NoPushIsZerosAndOnePassScales) {
  Fixture f;
  auto done = f.Sum({}, 0.25);
  ASSERT_TRUE(done.ok());
  for (float x : f.dst) ASSERT_EQ(x, 0.0f);
  auto a = Filled(4), b = Filled(8);
  std::vector<PushInput> in(2);
  in[0].data = a.data();
  in[1].data = b.data();
  ASSERT_TRUE(f.Sum(in, 0.25).ok());
  for (size_t i = 0; i < kN; i += 37) {
    ASSERT_EQ(f.dst[i], 0.25f * (12 + 2 * float(i % 7))) << i;
  }
}

TEST(LocalSumTest, AFailedReadOrStagingStopsTheSum) {
  Fixture f;
  auto a = Filled(1);
  std::vector<PushInput> in(2);
  in[0].data = a.data();
  in[1].read = [](uint8_t*, const MemRegion&) -> Result<const uint8_t*> {
    return UnavailableError("worker 1's memory: connection lost");
  };
  auto done = f.Sum(in);
  EXPECT_EQ(done.status().code(), StatusCode::kUnavailable);
  f.staging = [](uint64_t) -> Result<MemRegion*> {
    return ResourceExhaustedError("no staging buffer");
  };
  in[1].read = [&a](uint8_t*, const MemRegion&) {
    return Result<const uint8_t*>(reinterpret_cast<const uint8_t*>(a.data()));
  };
  EXPECT_EQ(f.Sum(in).status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace membox::ps
