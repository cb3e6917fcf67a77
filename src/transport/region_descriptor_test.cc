#include <gtest/gtest.h>

#include "membox/transport/mem_region.h"

namespace membox::transport {
namespace {

RegionDescriptor Sample() {
  RegionDescriptor d;
  d.address = 0x7f0000001000;
  d.length = 4096;
  d.region_id = 7;
  d.token = {0x1122334455667788, 0x1234567890abcdef};
  d.device_id = 99;
  d.packed_rkey = {1, 2, 3, 4, 5};
  return d;
}

TEST(RegionDescriptorTest, RoundTrip) {
  auto bytes = Sample().Serialize();
  auto d = RegionDescriptor::Deserialize(bytes);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->address, Sample().address);
  EXPECT_EQ(d->length, 4096u);
  EXPECT_EQ(d->token, Sample().token);
  EXPECT_EQ(d->packed_rkey, Sample().packed_rkey);
}

TEST(RegionDescriptorTest, RejectsBadInput) {
  auto bytes = Sample().Serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(RegionDescriptor::Deserialize({bytes.data(), n}).ok()) << n;
  }
  auto flipped = bytes;
  flipped[20] ^= 1;
  EXPECT_EQ(RegionDescriptor::Deserialize(flipped).status().code(),
            StatusCode::kDataLoss);
  auto magic = bytes;
  magic[0] = 'X';
  EXPECT_EQ(RegionDescriptor::Deserialize(magic).status().code(),
            StatusCode::kInvalidArgument);
  auto trailing = bytes;
  trailing.push_back(0);
  EXPECT_FALSE(RegionDescriptor::Deserialize(trailing).ok());
  RegionDescriptor zero = Sample();
  zero.length = 0;
  EXPECT_FALSE(RegionDescriptor::Deserialize(zero.Serialize()).ok());
  RegionDescriptor wrap = Sample();
  wrap.address = UINT64_MAX - 10;
  EXPECT_FALSE(RegionDescriptor::Deserialize(wrap.Serialize()).ok());
  RegionDescriptor big = Sample();
  big.packed_rkey.resize(RegionDescriptor::kMaxPackedRkey + 1);
  EXPECT_FALSE(RegionDescriptor::Deserialize(big.Serialize()).ok());
}

TEST(RegionDescriptorTest, SharedFileRoundTripsAndIsChecked) {
  RegionDescriptor d = Sample();
  SharedFile f;
  f.pid = 4242;
  f.fd = 17;
  f.offset = 8192;
  f.proof_fd = 5;
  for (size_t i = 0; i < f.proof.size(); ++i) f.proof[i] = uint8_t(i * 7);
  d.shared_file = f;
  auto bytes = d.Serialize();
  EXPECT_EQ(bytes[4], 4);  // version 4 only with a shared file
  EXPECT_EQ(Sample().Serialize()[4], 3);
  auto back = RegionDescriptor::Deserialize(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_TRUE(back->shared_file.has_value());
  EXPECT_EQ(back->shared_file->pid, 4242u);
  EXPECT_EQ(back->shared_file->fd, 17);
  EXPECT_EQ(back->shared_file->offset, 8192u);
  EXPECT_EQ(back->shared_file->proof_fd, 5);
  EXPECT_EQ(back->shared_file->proof, f.proof);
  EXPECT_FALSE(RegionDescriptor::Deserialize(Sample().Serialize())
                   ->shared_file.has_value());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(RegionDescriptor::Deserialize({bytes.data(), n}).ok()) << n;
  }
  RegionDescriptor nopid = d;
  nopid.shared_file->pid = 0;
  EXPECT_EQ(RegionDescriptor::Deserialize(nopid.Serialize()).status().code(),
            StatusCode::kInvalidArgument);
  RegionDescriptor badfd = d;
  badfd.shared_file->fd = -1;
  EXPECT_FALSE(RegionDescriptor::Deserialize(badfd.Serialize()).ok());
  RegionDescriptor wrap = d;
  wrap.shared_file->offset = UINT64_MAX - 100;
  EXPECT_FALSE(RegionDescriptor::Deserialize(wrap.Serialize()).ok());
}

}  // namespace
}  // namespace membox::transport
