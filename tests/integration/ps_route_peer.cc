// The worker of tests/netns/anti_locality_test.sh: profiles two proxies --
// "near" (low latency, low bandwidth) and "far" (high bandwidth, latency
// added by the transport's link model) -- checks the routing table, then
// times one synchronisation step of a model with many small and a few large
// tensors under the profiled table, under "everything near" and under
// "everything far".
// Usage: ps_route_peer NEAR FAR SECRET FAR_LATENCY_MS
// Prints ROUTING ... and TIME ... lines; exits 0 when the table is the
// anti-locality one and routed synchronisation beats both single proxies.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "membox/base/logging.h"
#include "membox/ps/param_client.h"

using namespace membox;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s NEAR FAR SECRET FAR_LATENCY_MS\n", argv[0]);
    return 2;
  }
  InitLogging("route-peer");
  ps::ParamClientOptions o;
  o.proxies = {argv[1], argv[2]};
  o.secret = argv[3];
  o.transports = "tcp";
  transport::FaultPolicy near, far;
  far.fixed_latency = std::chrono::milliseconds(std::atoi(argv[4]));
  o.links = {near, far};
  auto c = ps::ParamClient::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  auto& client = *c;
  ps::ProfileOptions po;
  po.sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
  po.repeats = 5;
  auto table = client->Profile(po);
  if (!table.ok()) {
    std::fprintf(stderr, "profile: %s\n", table.status().ToString().c_str());
    return 1;
  }
  std::printf("ROUTING %s\n", table->ToString().c_str());

  // 12 small tensors (16 KiB) synchronised one after the other, as layers
  // whose results are needed in turn, then 2 large ones (2 MiB) together.
  const int kSmall = 12, kLarge = 2;
  const size_t small = 16 << 10, large = 2 << 20;
  std::vector<void*> in, out;
  for (int i = 0; i < kSmall + kLarge; ++i) {
    size_t n = i < kSmall ? small : large;
    auto a = client->AllocateTensor(n), b = client->AllocateTensor(n);
    auto d = client->Declare(i + 1, n, DType::kFloat32);
    if (!a.ok() || !b.ok() || !d.ok()) {
      std::fprintf(stderr, "setup failed\n");
      return 1;
    }
    std::fill_n(static_cast<float*>(*a), n / 4, 1.0f);
    in.push_back(*a);
    out.push_back(*b);
  }
  auto step = [&]() -> double {
    auto t0 = Clock::now();
    for (int i = 0; i < kSmall; ++i) {
      Status s = client->PushPull(i + 1, in[i], out[i]).Wait();
      if (!s.ok()) {
        std::fprintf(stderr, "pushpull: %s\n", s.ToString().c_str());
        std::exit(1);
      }
    }
    std::vector<ps::PsHandle> h;
    for (int i = kSmall; i < kSmall + kLarge; ++i) {
      h.push_back(client->PushPull(i + 1, in[i], out[i]));
    }
    for (auto& x : h) {
      Status s = x.Wait();
      if (!s.ok()) {
        std::fprintf(stderr, "pushpull: %s\n", s.ToString().c_str());
        std::exit(1);
      }
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto measure = [&](const ps::RoutingTable& t) {
    client->SetRouting(t);
    std::vector<double> v;
    step();  // warm-up
    for (int i = 0; i < 5; ++i) v.push_back(step());
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  ps::RoutingTable only_near = *table, only_far = *table;
  only_near.lat_proxy = only_near.bw_proxy = 0;
  only_far.lat_proxy = only_far.bw_proxy = 1;
  double routed = measure(*table);
  double n = measure(only_near);
  double f = measure(only_far);
  std::printf("TIME routed %.4f near-only %.4f far-only %.4f s\n", routed, n,
              f);
  bool ok = table->lat_proxy == 0 && table->bw_proxy == 1 &&
            table->threshold > small && table->threshold < large &&
            routed < n && routed < f;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
