// Attaching a combined key's region, over two devices on loopback: what the
// node offers is mapped and checked against what the worker declared.
#include "src/ps/client/combining.h"

#include <cstring>

#include <gtest/gtest.h>

#include "tests/support/testing.h"

namespace membox::ps::client {
namespace {

using transport::DeviceOptions;
using transport::ProtocolChoice;

class CombiningTest : public ::testing::Test {
 protected:
  // The node's region for a key of 1 KiB float32 and 2 workers; the
  // worker's channel to it over `protocol`.
  void Start(ProtocolChoice protocol) {
    DeviceOptions o;
    o.protocol = protocol;
    auto p = test_support::ConnectDevices(o, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    devices_ = std::move(*p);
    g_.world = 2;
    g_.bytes = 1024;
    g_.dtype = DType::kFloat32;
    auto r = devices_.server->AllocateMemRegion(g_.region_bytes());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    region_ = std::move(*r);
    InitCombineRegion(region_->data(), g_);
    descriptor_.clear();
    for (uint8_t b : region_->Export().Serialize()) descriptor_.push_back(b);
  }
  CombineRequest Request() const {
    CombineRequest r;
    r.key = 7;
    r.world = 2;
    r.rank = 1;
    r.bytes = 1024;
    r.dtype = DType::kFloat32;
    r.from = 3;
    r.next_round = 3;
    return r;
  }

  test_support::DevicePair devices_;
  CombineGeometry g_;
  std::unique_ptr<transport::MemRegion> region_;
  std::string descriptor_;
};

TEST_F(CombiningTest, MapsTheRegionAndViewsItFromTheOfferedRound) {
  Start(ProtocolChoice::kAuto);  // one host: mapped
  auto a = AttachCombineRegion(*devices_.to_server, descriptor_, Request());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_NE(a->region->mapped(), nullptr);
  EXPECT_EQ(a->view.geometry().world, 2u);
  EXPECT_EQ(a->view.geometry().bytes, 1024u);
  // The view is the node's memory: what the worker publishes lands there.
  EXPECT_TRUE(a->view.CanPublish(3));
}

TEST_F(CombiningTest, RefusesWhatDoesNotMatch) {
  Start(ProtocolChoice::kAuto);
  CombineRequest r = Request();
  r.next_round = 4;  // the node combines from 3: the worker is ahead
  auto a = AttachCombineRegion(*devices_.to_server, descriptor_, r);
  EXPECT_EQ(a.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(a.status().message().find("from round 3"), std::string::npos);
  r = Request();
  r.bytes = 2048;  // not what the region holds
  EXPECT_FALSE(AttachCombineRegion(*devices_.to_server, descriptor_, r).ok());
  r = Request();
  r.world = 3;
  EXPECT_FALSE(AttachCombineRegion(*devices_.to_server, descriptor_, r).ok());
  // A descriptor that does not decode.
  EXPECT_FALSE(
      AttachCombineRegion(*devices_.to_server, "not a descriptor", Request())
          .ok());
  std::string cut = descriptor_.substr(0, descriptor_.size() / 2);
  EXPECT_FALSE(AttachCombineRegion(*devices_.to_server, cut, Request()).ok());
}

TEST_F(CombiningTest, ARegionThisProcessCannotMapIsRefused) {
  Start(ProtocolChoice::kNoMapping);  // as across hosts
  auto a = AttachCombineRegion(*devices_.to_server, descriptor_, Request());
  EXPECT_EQ(a.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(a.status().message().find("cannot map"), std::string::npos);
}

}  // namespace
}  // namespace membox::ps::client
