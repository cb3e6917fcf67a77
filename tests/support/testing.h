// Helpers the unit tests of every layer share: two devices connected on
// loopback, a fresh directory per test, and damage to a request's body for
// the hostile-peer tests. Test code only; it uses public headers alone, so
// it sits below every layer (docs/design/layers.md, "Tests").
//
// Threading: each function runs on the caller's thread and returns when
// done. Ownership: what it makes is the caller's.
#ifndef MEMBOX_TESTS_SUPPORT_TESTING_H_
#define MEMBOX_TESTS_SUPPORT_TESTING_H_

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "membox/base/status.h"
#include "membox/service/envelope.h"
#include "membox/transport/channel.h"
#include "membox/transport/device.h"

namespace membox::test_support {

// A listening device and a client device with a channel each way.
struct DevicePair {
  std::unique_ptr<transport::Device> server, client;
  std::shared_ptr<transport::Channel> to_server;  // the client's
  std::shared_ptr<transport::Channel> to_client;  // the server's (accepted)
};

// Starts `server` listening on 127.0.0.1 (any port) and `client` with no
// listener, connects the client and accepts on the server.
inline Result<DevicePair> ConnectDevices(transport::DeviceOptions server,
                                         transport::DeviceOptions client) {
  DevicePair p;
  server.listen_address = "127.0.0.1:0";
  client.listen_address = "";
  auto s = transport::Device::Create(server);
  if (!s.ok()) return s.status();
  p.server = std::move(*s);
  auto c = transport::Device::Create(client);
  if (!c.ok()) return c.status();
  p.client = std::move(*c);
  auto ch = p.client->GetChannel(p.server->listen_endpoint(), 0);
  if (!ch.ok()) return ch.status();
  p.to_server = *ch;
  auto a = p.server->Accept(std::chrono::seconds(10));
  if (!a.ok()) return a.status();
  p.to_client = *a;
  return p;
}

// An empty directory for the running test: <tmp>/membox-<prefix>-<pid>-<test
// name>, removed first if a crashed run left it.
inline std::filesystem::path FreshTestDir(const std::string& prefix) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? info->name() : "none";
  for (char& ch : name) {
    if (ch == '/') ch = '_';  // parameterized tests' names
  }
  auto dir =
      std::filesystem::temp_directory_path() /
      ("membox-" + prefix + "-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Damages an encoded request's body (never the envelope's header, which
// only closes the link): flips one byte or cuts the message short there.
inline void DamageBody(std::vector<uint8_t>& msg, std::mt19937_64& rng) {
  if (msg.size() <= service::kHeaderBytes + 1) return;
  const size_t at =
      service::kHeaderBytes + rng() % (msg.size() - service::kHeaderBytes);
  if (rng() % 2) {
    msg[at] ^= static_cast<uint8_t>(1 + rng() % 255);
  } else {
    msg.resize(at);
  }
}

}  // namespace membox::test_support

#endif  // MEMBOX_TESTS_SUPPORT_TESTING_H_
