// A memory node with all three services, used through each service's
// client, and a node whose last service cannot start.
#include "membox/node/memory_node.h"

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "membox/embedding/client.h"
#include "membox/memserver/client.h"
#include "membox/node/metrics_endpoint.h"
#include "membox/ps/param_client.h"

#include "tests/support/testing.h"

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
  void SetUp() override { dir_ = test_support::FreshTestDir("node-test"); }
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

// Sends `request` to 127.0.0.1:port and returns everything the peer sends
// back before closing (or "" when it cannot connect).
std::string Http(int port, const std::string& request) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

int IdleConnection(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

// The metrics endpoint: a scrape shows every service's figures (a round the
// proxy ran, the request latency histogram), and garbage, other methods,
// other paths, oversized requests and idle connections get bounded answers
// while scrapes go on.
TEST_F(MemoryNodeTest, ServesPrometheusMetricsAndShrugsOffBadRequests) {
  MemoryNodeOptions o = AllThree(dir_.string());
  o.metrics_listen = "127.0.0.1:0";
  auto n = MemoryNode::Start(o);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  MemoryNode& node = **n;
  const std::string ep = node.metrics_endpoint();
  ASSERT_FALSE(ep.empty());
  EXPECT_NE(node.Describe().find("metrics http://" + ep + "/metrics"),
            std::string::npos);
  const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
  ASSERT_GT(port, 0);

  ps::ParamClientOptions po;
  po.proxies = {node.proxy()->endpoint()};
  po.secret = kSecret;
  auto pc = ps::ParamClient::Connect(po);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  ASSERT_TRUE((*pc)->Declare(3, 64, DType::kFloat32).ok());
  std::vector<float> in(16, 1.0f), out(16);
  ASSERT_TRUE((*pc)->PushPull(3, in.data(), out.data()).Wait().ok());

  std::string page = Http(port,
                          "GET /metrics HTTP/1.1\r\nHost: x\r\n"
                          "Connection: close\r\n\r\n");
  EXPECT_EQ(page.rfind("HTTP/1.1 200", 0), 0u) << page;
  EXPECT_NE(page.find("text/plain; version=0.0.4"), std::string::npos);
  for (const char* want :
       {"\nmembox_up 1\n", "\nmembox_ps_rounds_total 1\n",
        "\nmembox_ps_workers 1\n", "\nmembox_ps_pushed_bytes_total 64\n",
        "\nmembox_ps_result_bytes_total 64\n", "\nmembox_pool_bytes 16777216\n",
        "\nmembox_embedding_tables 0\n",
        "# TYPE membox_request_latency_seconds histogram\n",
        "membox_request_latency_seconds_count{service=\"proxy\"} ",
        "membox_request_latency_seconds_bucket{service=\"memory\",le=\"+Inf\"}",
        "membox_requests_total{service=\"embedding\"} 0\n"}) {
    EXPECT_NE(page.find(want), std::string::npos) << want << "\n" << page;
  }
  // Requests answered: the proxy's hello, declare, region, push at least.
  const std::string count =
      "membox_request_latency_seconds_count{service=\"proxy\"} ";
  auto pos = page.find(count);
  ASSERT_NE(pos, std::string::npos);
  EXPECT_GE(std::stoi(page.substr(pos + count.size())), 3)
      << page.substr(pos, 80);

  // What the port must shrug off.
  std::vector<int> idle;
  for (int i = 0; i < 6; ++i) idle.push_back(IdleConnection(port));
  EXPECT_NE(Http(port,
                 "POST /metrics HTTP/1.1\r\nHost: x\r\n"
                 "Content-Length: 5\r\n\r\nhello")
                .find(" 405 "),
            std::string::npos);
  EXPECT_NE(Http(port, "GET /secrets HTTP/1.0\r\n\r\n").find(" 404 "),
            std::string::npos);
  std::string head = Http(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_NE(head.find(" 200 "), std::string::npos);
  EXPECT_EQ(head.find("membox_up"), std::string::npos);
  std::string junk(4096, '\xff');
  (void)Http(port, junk);
  std::string huge = "GET /" + std::string(64 << 10, 'a') + " HTTP/1.1\r\n\r\n";
  std::string refused = Http(port, huge);
  EXPECT_EQ(refused.find("membox_up"), std::string::npos);
  EXPECT_NE(Http(port, "GET /metrics HTTP/1.0\r\n\r\n").find("membox_up 1"),
            std::string::npos);
  for (int fd : idle) close(fd);
  pc->reset();
  node.Stop();
  EXPECT_EQ(Http(port, "GET /metrics HTTP/1.0\r\n\r\n"), "");
}

// Connections that trickle a byte now and then (each byte resets the idle
// timeout) fill the connection budget only until the request deadline; a
// bearer token keeps strangers out.
TEST(MetricsEndpointTest, TricklersExpireAndTheTokenIsChecked) {
  MetricsEndpointOptions mo;
  mo.listen = "127.0.0.1:0";
  mo.max_connections = 8;
  mo.max_per_address = 8;
  mo.request_deadline = std::chrono::milliseconds(500);
  mo.bearer_token = "scrape-token";
  auto e = MetricsEndpoint::Start(mo, [] { return std::string("up 1\n"); });
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const std::string ep = (*e)->endpoint();
  const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
  std::vector<int> slow;
  for (int i = 0; i < 8; ++i) {
    int fd = IdleConnection(port);
    (void)!write(fd, "G", 1);
    slow.push_back(fd);
  }
  // Keep trickling for longer than the deadline.
  for (int t = 0; t < 8; ++t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    for (int fd : slow) (void)!send(fd, "E", 1, MSG_NOSIGNAL);
  }
  std::string page = Http(
      port,
      "GET /metrics HTTP/1.0\r\nAuthorization: Bearer scrape-token\r\n\r\n");
  EXPECT_NE(page.find("up 1"), std::string::npos) << page;
  EXPECT_NE(Http(port, "GET /metrics HTTP/1.0\r\n\r\n").find(" 401 "),
            std::string::npos);
  EXPECT_NE(
      Http(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer wrong\r\n\r\n")
          .find(" 401 "),
      std::string::npos);
  for (int fd : slow) close(fd);
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
