#include "src/embedding/protocol.h"

#include <cstring>

#include <gtest/gtest.h>

#include "membox/service/envelope.h"
#include "membox/transport/channel.h"

namespace membox::embedding::proto {
namespace {

using service::kHeaderBytes;

// The body Encode wrote after the envelope's header room.
std::vector<uint8_t> Body(const Message& m) {
  auto b = Encode(m);
  return {b.begin() + kHeaderBytes, b.end()};
}

Result<Message> RoundTrip(const Message& m) {
  return Decode(static_cast<uint16_t>(m.type), Body(m));
}

TEST(EmbeddingProtocolTest, RoundTripsEveryType) {
  Message push;
  push.type = Type::kPush;
  push.batch = 77;
  push.seq = 0x0102030405060708ull;
  push.floor = 0x0102030405060700ull;
  push.sections.push_back(
      {2, true, {1, 2, 3}, {0.5f, -1.f, 2.f, 3.f, 4.f, 5.f}});
  push.sections.push_back({0, false, {9}, {1.f}});
  push.sections.push_back({4, true, {}, {}});  // a release alone
  auto d = RoundTrip(push);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->sections, push.sections);
  EXPECT_EQ(d->batch, 77u);
  EXPECT_EQ(d->seq, push.seq);
  EXPECT_EQ(d->floor, push.floor);
  Message ahead = push;  // a floor at or above its own number: refused
  ahead.floor = ahead.seq;
  EXPECT_FALSE(RoundTrip(ahead).ok());

  Message hello;
  hello.type = Type::kHello;
  hello.name = "w0";
  hello.client_id = 0xfeedfacecafebeefull;
  hello.rejoin = true;
  auto h = RoundTrip(hello);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->name, "w0");
  EXPECT_EQ(h->client_id, hello.client_id);
  EXPECT_TRUE(h->rejoin);

  Message pull;
  pull.type = Type::kPull;
  pull.batch = 3;
  pull.sections.push_back({1, false, {4, 5}, {}});
  pull.sections.push_back({2, false, {6}, {}});
  auto pd = RoundTrip(pull);
  ASSERT_TRUE(pd.ok()) << pd.status().ToString();
  EXPECT_EQ(pd->sections, pull.sections);

  Message open;
  open.type = Type::kOpenTable;
  open.table.name = "ids";
  open.table.dim = 16;
  open.table.optimizer = RowOptimizer::kAdam;
  open.table.seed = 5;
  auto o = RoundTrip(open);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->table, open.table);

  Message rep;
  rep.type = Type::kReplicate;
  rep.name = "node-1";
  rep.table = open.table;
  rep.seq = 9;
  rep.rejoin = true;
  rep.sections.push_back({0, false, {4, 5}, {1.f, 2.f, 3.f, 4.f}});
  rep.applied.push_back({7, 2, 5});
  auto rd = RoundTrip(rep);
  ASSERT_TRUE(rd.ok()) << rd.status().ToString();
  EXPECT_EQ(rd->name, "node-1");
  EXPECT_EQ(rd->table, rep.table);
  EXPECT_EQ(rd->seq, 9u);
  EXPECT_TRUE(rd->rejoin);
  EXPECT_EQ(rd->sections, rep.sections);
  EXPECT_EQ(rd->applied, rep.applied);
  Message two = rep;  // one table's rows per replica message
  two.sections.push_back(rep.sections[0]);
  EXPECT_FALSE(RoundTrip(two).ok());

  Message fetch;
  fetch.type = Type::kFetchReplica;
  fetch.name = "node-1";
  fetch.table_id = 3;
  fetch.seq = 1000;
  auto fd = RoundTrip(fetch);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_EQ(fd->table_id, 3u);
  EXPECT_EQ(fd->seq, 1000u);

  Message answer;  // a push's: the floor the backup holds
  answer.type = Type::kReply;
  answer.floor = 41;
  auto ad = RoundTrip(answer);
  ASSERT_TRUE(ad.ok()) << ad.status().ToString();
  EXPECT_EQ(ad->floor, 41u);

  Message where;  // where the node in place 2 listens now
  where.type = Type::kWhere;
  where.table_id = 2;
  auto wd = RoundTrip(where);
  ASSERT_TRUE(wd.ok()) << wd.status().ToString();
  EXPECT_EQ(wd->table_id, 2u);
  where.table_id = kMaxPlaces;  // no job has that many nodes
  EXPECT_FALSE(RoundTrip(where).ok());

  Message announce;  // the node in place 1 listens here now
  announce.type = Type::kAnnounce;
  announce.table_id = 1;
  announce.name = "10.0.0.9:7320";
  auto and_ = RoundTrip(announce);
  ASSERT_TRUE(and_.ok()) << and_.status().ToString();
  EXPECT_EQ(and_->table_id, 1u);
  EXPECT_EQ(and_->name, "10.0.0.9:7320");
  announce.name.clear();  // an announce names its endpoint
  EXPECT_FALSE(RoundTrip(announce).ok());

  for (Type t : {Type::kHello, Type::kPull, Type::kRelease, Type::kFlush,
                 Type::kStats, Type::kReply}) {
    Message m;
    m.type = t;
    m.text = "x";
    auto r = RoundTrip(m);
    EXPECT_TRUE(r.ok()) << TypeName(t) << ": " << r.status().ToString();
  }
}

TEST(EmbeddingProtocolTest, RejectsDamagedInput) {
  Message m;
  m.type = Type::kPull;
  m.sections.push_back({0, false, {1, 2, 3}, {}});
  auto b = Body(m);
  const uint16_t pull = static_cast<uint16_t>(Type::kPull);
  for (size_t n = 0; n < b.size(); ++n) {
    EXPECT_FALSE(Decode(pull, {b.data(), n}).ok()) << "prefix " << n;
  }
  auto longer = b;
  longer.push_back(0);
  EXPECT_FALSE(Decode(pull, longer).ok());
  EXPECT_FALSE(Decode(99, b).ok());
  EXPECT_FALSE(Decode(0, b).ok());
  auto bad_version = b;
  bad_version[1] = 2;
  EXPECT_FALSE(Decode(pull, bad_version).ok());
  // A key count far beyond the bytes present is refused before allocating.
  auto huge = b;
  uint32_t n = 0xFFFFFFF0u;
  std::memcpy(huge.data() + 2 + 8 + 4 + 4, &n, 4);
  auto r = Decode(pull, huge);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pull"), std::string::npos);
  // So is a section count far beyond the bytes present or the limit.
  auto many = b;
  std::memcpy(many.data() + 2 + 8, &n, 4);
  EXPECT_FALSE(Decode(pull, many).ok());
  // Sections whose keys add up beyond kMaxKeys are refused.
  Message big;
  big.type = Type::kPull;
  big.sections.push_back({0, false, std::vector<uint64_t>(kMaxKeys, 1), {}});
  big.sections.push_back({1, false, {2}, {}});
  EXPECT_FALSE(RoundTrip(big).ok());
  big.sections.pop_back();
  EXPECT_TRUE(RoundTrip(big).ok());
  Message open;
  open.type = Type::kOpenTable;
  open.table.name = "t";
  auto ob = Body(open);
  ob[2 + 4 + 1 + 4] = 7;  // optimizer byte
  EXPECT_FALSE(Decode(static_cast<uint16_t>(Type::kOpenTable), ob).ok());
}

TEST(EmbeddingProtocolTest, MessagesOfMaxKeysFitAControlMessage) {
  for (uint32_t dim : {1u, 8u, 64u, 1000u, 4096u}) {
    uint32_t k = MaxKeysPerMessage(dim);
    ASSERT_GE(k, 1u);
    Message m;
    m.type = Type::kPush;
    m.sections.push_back({0, true, std::vector<uint64_t>(k, 1),
                          std::vector<float>(size_t(k) * dim, 1.f)});
    EXPECT_LE(Encode(m).size(), transport::Channel::kMaxControlMessage) << dim;
    Message r;
    r.type = Type::kReply;
    r.values = m.sections[0].values;
    EXPECT_LE(Encode(r).size(), transport::Channel::kMaxControlMessage);
  }
}

}  // namespace
}  // namespace membox::embedding::proto
