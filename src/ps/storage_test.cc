// Shard storage alone: the byte limit, copy-on-write against snapshots, the
// three kinds of update, and loading a checkpoint record.
#include "src/ps/storage.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace membox::ps {
namespace {

using transport::MemRegion;
using transport::RegionDescriptor;

// Plain heap memory: storage needs nothing from a transport but the bytes.
class HeapRegion final : public MemRegion {
 public:
  explicit HeapRegion(size_t n)
      : MemRegion(new uint8_t[n], n, /*id=*/1, /*device_allocated=*/false) {}
  ~HeapRegion() override { delete[] static_cast<uint8_t*>(data()); }
  RegionDescriptor Export() const override { return {}; }
  Result<RegionDescriptor> ExportRange(uint64_t, uint64_t) override {
    return UnimplementedError("heap");
  }
  void RevokeRange(uint64_t) override {}
};

class StorageTest : public ::testing::Test {
 protected:
  StorageTest()
      : cores_(1),
        storage_(
            [](uint64_t n) -> Result<std::unique_ptr<MemRegion>> {
              return std::unique_ptr<MemRegion>(new HeapRegion(n));
            },
            4096, &cores_) {}

  static void Fill(const std::shared_ptr<MemRegion>& r, float v) {
    auto* p = static_cast<float*>(r->data());
    for (size_t i = 0; i < r->size() / 4; ++i) p[i] = v;
  }
  static float At(const std::shared_ptr<MemRegion>& r, size_t i = 0) {
    return static_cast<const float*>(r->data())[i];
  }

  SyncCores cores_;
  ShardStorage storage_;
};

TEST_F(StorageTest, TheLimitHoldsAndFreedBytesReturn) {
  auto a = storage_.Allocate(3000);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(storage_.stored_bytes(), 3000u);
  EXPECT_EQ(static_cast<const uint8_t*>((*a)->data())[2999], 0);  // zeroed
  auto b = storage_.Allocate(2000);
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("--ps-max-bytes"), std::string::npos);
  a->reset();
  EXPECT_EQ(storage_.stored_bytes(), 0u);
  EXPECT_TRUE(storage_.Allocate(2000).ok());
}

TEST(RegionRecyclerTest, KeepsBuffersBySizeUpToItsCapUntilClosed) {
  RegionRecycler r(100);
  std::unique_ptr<MemRegion> a(new HeapRegion(60)), b(new HeapRegion(60));
  void* a_data = a->data();
  ASSERT_TRUE(r.Put(a, 60));
  EXPECT_EQ(a, nullptr);  // kept
  EXPECT_FALSE(r.Put(b, 60)) << "past the cap";
  EXPECT_NE(b, nullptr) << "left to the caller";
  EXPECT_EQ(r.bytes(), 60u);
  EXPECT_EQ(r.Take(40), nullptr) << "exact sizes only";
  auto again = r.Take(60);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->data(), a_data);
  EXPECT_EQ(r.bytes(), 0u);
  ASSERT_TRUE(r.Put(again, 60));
  r.Clear();
  EXPECT_EQ(r.bytes(), 0u);
  EXPECT_EQ(r.Take(60), nullptr);
  r.LowerCap(50);
  EXPECT_FALSE(r.Put(b, 60)) << "past the lowered cap";
  r.Close();
  std::unique_ptr<MemRegion> small(new HeapRegion(10));
  EXPECT_FALSE(r.Put(small, 10)) << "closed";
  EXPECT_NE(b, nullptr);
}

// A buffer let go of is handed out again for the same size (no fresh
// allocation, hence no page faults), zeroed by Allocate, and counted as
// stored only while held; TrimRecycled and CloseRecycling free the kept.
TEST(StorageRecyclingTest, AFreedBufferIsReusedForTheSameSize) {
  SyncCores cores(1);
  int allocations = 0;
  ShardStorage storage(
      [&](uint64_t n) -> Result<std::unique_ptr<MemRegion>> {
        ++allocations;
        return std::unique_ptr<MemRegion>(new HeapRegion(n));
      },
      1 << 20, &cores, /*recycle_bytes=*/4096);
  auto a = *storage.AllocateForOverwrite(1024);
  std::memset(a->data(), 7, 1024);
  void* data = a->data();
  a.reset();
  EXPECT_EQ(storage.stored_bytes(), 0u);
  EXPECT_EQ(storage.recycled_bytes(), 1024u);
  auto b = *storage.Allocate(1024);
  EXPECT_EQ(allocations, 1);
  EXPECT_EQ(b->data(), data);
  EXPECT_EQ(static_cast<const uint8_t*>(b->data())[1023], 0) << "zeroed";
  EXPECT_EQ(storage.stored_bytes(), 1024u);
  EXPECT_EQ(storage.recycled_bytes(), 0u);
  auto c = *storage.Allocate(2048);  // another size: a fresh one
  EXPECT_EQ(allocations, 2);
  b.reset();
  c.reset();
  EXPECT_EQ(storage.recycled_bytes(), 3072u);
  storage.TrimRecycled();
  EXPECT_EQ(storage.recycled_bytes(), 0u);
  ASSERT_TRUE(storage.Allocate(1024).ok());
  EXPECT_EQ(allocations, 3) << "trimmed: allocated afresh";
  storage.CloseRecycling();
  auto d = *storage.Allocate(1024);
  d.reset();
  EXPECT_EQ(storage.recycled_bytes(), 0u) << "closed: freed at once";
}

// A buffer kept as a version only: fresh memory is left untouched (the
// allocator's new mappings are zero), a recycled one is cleared.
TEST(StorageRecyclingTest, AnUntouchedBufferIsZeroedOnlyWhenRecycled) {
  SyncCores cores(1);
  ShardStorage storage(
      [&](uint64_t n) -> Result<std::unique_ptr<MemRegion>> {
        auto r = std::make_unique<HeapRegion>(n);
        std::memset(r->data(), 0x5a, n);  // marks what was not cleared
        return std::unique_ptr<MemRegion>(std::move(r));
      },
      1 << 20, &cores, /*recycle_bytes=*/4096);
  auto fresh = *storage.AllocateUntouched(1024);
  EXPECT_EQ(static_cast<const uint8_t*>(fresh->data())[7], 0x5a)
      << "fresh memory is not written";
  std::memset(fresh->data(), 7, 1024);  // an earlier job's bytes
  fresh.reset();
  auto again = *storage.AllocateUntouched(1024);
  for (size_t i = 0; i < 1024; ++i) {
    ASSERT_EQ(static_cast<const uint8_t*>(again->data())[i], 0) << i;
  }
  EXPECT_EQ(storage.stored_bytes(), 1024u);
}

TEST_F(StorageTest, ReplaceSwapsTheSumInAndScales) {
  StoredShard sh;
  ASSERT_TRUE(storage_.Create(sh, 0, 64).ok());
  ASSERT_TRUE((sh.scratch = *storage_.Allocate(64)));
  Fill(sh.value, 1);
  Fill(sh.scratch, 8);
  MemRegion* old_scratch = sh.scratch.get();
  ASSERT_TRUE(storage_
                  .Apply(DType::kFloat32, {}, Update::kReplace, sh,
                         sh.scratch.get(), 0.25)
                  .ok());
  EXPECT_EQ(sh.value.get(), old_scratch);  // swapped, not copied
  EXPECT_EQ(At(sh.value), 2.0f);
}

TEST_F(StorageTest, ASnapshotKeepsTheVersionItSaw) {
  StoredShard sh;
  ASSERT_TRUE(storage_.Create(sh, 0, 16).ok());
  Fill(sh.value, 3);
  sh.version = 7;
  auto snap = ShardStorage::Snap(5, 0, DType::kFloat32, 16, 16, sh);
  EXPECT_EQ(snap.record.version, 7u);
  auto g = *storage_.Allocate(16);
  Fill(g, 1);
  ASSERT_TRUE(
      storage_.Apply(DType::kFloat32, {}, Update::kAdd, sh, g.get(), 1.0).ok());
  EXPECT_EQ(At(sh.value), 4.0f);
  float seen;
  std::memcpy(&seen, snap.record.value.data(), 4);
  EXPECT_EQ(seen, 3.0f);  // copied on write, the snapshot is intact
  EXPECT_NE(sh.value.get(), snap.keep[0].get());
}

TEST_F(StorageTest, SgdWithMomentumFollowsPyTorch) {
  StoredShard sh;
  ASSERT_TRUE(storage_.Create(sh, 0, 8).ok());
  Fill(sh.value, 1);
  OptimizerSettings opt;
  opt.kind = proto::Optimizer::kSgd;
  opt.lr = 0.1;
  opt.momentum = 0.9;
  auto g = *storage_.Allocate(8);
  Fill(g, 1);
  // Half of the gradient counts (averaging over two workers).
  ASSERT_TRUE(
      storage_.Apply(DType::kFloat32, opt, Update::kOptimizer, sh, g.get(), 0.5)
          .ok());
  // m = 0.5, w = 1 - 0.05
  EXPECT_FLOAT_EQ(At(sh.value), 0.95f);
  EXPECT_FLOAT_EQ(At(sh.m1), 0.5f);
  auto snap = ShardStorage::Snap(1, 0, DType::kFloat32, 8, 8, sh);
  ASSERT_TRUE(
      storage_.Apply(DType::kFloat32, opt, Update::kOptimizer, sh, g.get(), 0.5)
          .ok());
  // m = 0.9 * 0.5 + 0.5 = 0.95, w = 0.95 - 0.095
  EXPECT_FLOAT_EQ(At(sh.m1), 0.95f);
  EXPECT_FLOAT_EQ(At(sh.value), 0.855f);
  // The value before this step stays, for a restarted worker's recompute.
  ASSERT_TRUE(sh.previous);
  EXPECT_FLOAT_EQ(At(sh.previous), 0.95f);
  EXPECT_NE(sh.previous->data(), sh.value->data());
  float m_seen;
  std::memcpy(&m_seen, snap.record.m1.data(), 4);
  EXPECT_FLOAT_EQ(m_seen, 0.5f);  // optimizer state is copied on write too
  OptimizerSettings none;
  EXPECT_EQ(
      storage_
          .Apply(DType::kFloat32, none, Update::kOptimizer, sh, g.get(), 1.0)
          .code(),
      StatusCode::kInternal);
}

TEST_F(StorageTest, LoadTakesARecordAndRefusesAWrongSize) {
  StoredShard src;
  ASSERT_TRUE(storage_.Create(src, 0, 12).ok());
  Fill(src.value, 6);
  src.version = 3;
  auto snap = ShardStorage::Snap(9, 0, DType::kFloat32, 12, 12, src);
  CheckpointShard rec = snap.record;  // views of src's buffers
  StoredShard dst;
  dst.bytes = 12;
  ASSERT_TRUE(storage_.Load(dst, rec).ok());
  EXPECT_EQ(dst.version, 3u);
  EXPECT_EQ(At(dst.value, 2), 6.0f);
  EXPECT_EQ(dst.m1, nullptr);
  rec.value = rec.value.first(8);
  EXPECT_EQ(storage_.Load(dst, rec).code(), StatusCode::kDataLoss);
  rec.value = snap.record.value;
  rec.m1 = rec.value.first(4);
  EXPECT_EQ(storage_.Load(dst, rec).code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace membox::ps
