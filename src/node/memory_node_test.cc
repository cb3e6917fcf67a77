// A memory node with all three services, used through each service's
// client, and a node whose last service cannot start.
#include "membox/node/memory_node.h"

#include <filesystem>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "membox/embedding/client.h"
#include "membox/memserver/client.h"
#include "membox/ps/param_client.h"

namespace membox::node {
namespace {

constexpr char kSecret[] = "memory-node-test-secret";

MemoryNodeOptions AllThree(const std::string& dir) {
  MemoryNodeOptions o;
  o.secret = kSecret;
  o.memory.listen = "127.0.0.1:0";
  o.memory.pool_bytes = 16 << 20;
  o.memory.max_block = 16 << 20;
  o.proxy.emplace();
  o.proxy->listen = "127.0.0.1:0";
  o.embedding.emplace();
  o.embedding->listen = "127.0.0.1:0";
  o.embedding->dir = dir;
  return o;
}

class MemoryNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("membox-node-test-" + std::to_string(getpid()));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(MemoryNodeTest, ServesAllThreeServicesWithOneSecret) {
  auto n = MemoryNode::Start(AllThree(dir_.string()));
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  MemoryNode& node = **n;
  ASSERT_NE(node.proxy(), nullptr);
  ASSERT_NE(node.embedding(), nullptr);
  EXPECT_NE(node.Describe().find("embedding server 127.0.0.1:"),
            std::string::npos);

  memserver::ClientOptions mo;
  mo.server = node.memory().endpoint();
  mo.secret = kSecret;
  auto mc = memserver::Client::Connect(mo);
  ASSERT_TRUE(mc.ok()) << mc.status().ToString();
  auto seg = (*mc)->Create(0, 4096);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();

  ps::ParamClientOptions po;
  po.proxies = {node.proxy()->endpoint()};
  po.secret = kSecret;
  auto pc = ps::ParamClient::Connect(po);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  auto text = (*pc)->ProxyStatus(0);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_NE(text->find("clients 1"), std::string::npos) << *text;

  embedding::EmbeddingClientOptions eo;
  eo.nodes = {node.embedding()->endpoint()};
  eo.secret = kSecret;
  auto ec = embedding::EmbeddingClient::Connect(eo);
  ASSERT_TRUE(ec.ok()) << ec.status().ToString();
  embedding::TableConfig t;
  t.name = "ids";
  t.dim = 4;
  auto id = (*ec)->OpenTable(t);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  std::vector<uint64_t> keys = {1, 2, 3};
  std::vector<float> rows(keys.size() * 4);
  EXPECT_TRUE((*ec)->Pull(*id, keys, rows.data()).ok());

  ec->reset();
  pc->reset();
  mc->reset();
  node.Stop();
  node.Stop();  // idempotent
}

TEST_F(MemoryNodeTest, AServiceThatCannotStartStopsTheOthers) {
  MemoryNodeOptions o = AllThree("");  // the embedding server needs a dir
  auto n = MemoryNode::Start(o);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(n.status().ToString().find("embedding server"), std::string::npos)
      << n.status().ToString();
  // A short secret is refused by the first service.
  o = AllThree(dir_.string());
  o.secret = "short";
  n = MemoryNode::Start(o);
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().ToString().find("memory server"), std::string::npos);
}

}  // namespace
}  // namespace membox::node
