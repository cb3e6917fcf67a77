#include "membox/ps/routing.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

namespace membox::ps {

std::string RoutingTable::ToString() const {
  std::ostringstream o;
  o << "S=" << threshold << " LatProxy=" << lat_proxy << " BwProxy=" << bw_proxy
    << " S'=" << partition_bytes << " P=" << pipeline_bytes
    << (stripe ? " striped" : "");
  return o.str();
}

Result<RoutingTable> ChooseRouting(const std::vector<ProfileSample>& samples,
                                   double full_bandwidth_fraction,
                                   double stripe_gain) {
  std::map<uint32_t, std::map<uint64_t, double>> t;  // proxy -> size -> s
  std::set<uint64_t> sizes;
  for (const auto& s : samples) {
    if (s.bytes == 0 || !(s.seconds > 0) || !std::isfinite(s.seconds)) {
      return InvalidArgumentError("profile sample with no size or no time");
    }
    t[s.proxy][s.bytes] = s.seconds;
    sizes.insert(s.bytes);
  }
  if (t.empty()) return InvalidArgumentError("no profile samples");
  for (auto& [p, m] : t) {
    if (m.size() != sizes.size()) {
      return InvalidArgumentError("proxy " + std::to_string(p) +
                                  " was not measured at every size");
    }
  }
  const uint64_t smallest = *sizes.begin(), largest = *sizes.rbegin();
  RoutingTable r;
  double best_lat = INFINITY, best_bw = 0;
  for (auto& [p, m] : t) {
    if (m[smallest] < best_lat) best_lat = m[smallest], r.lat_proxy = p;
    double bw = static_cast<double>(largest) / m[largest];
    if (bw > best_bw) best_bw = bw, r.bw_proxy = p;
  }
  if (r.lat_proxy == r.bw_proxy) {
    r.threshold = 0;  // everything to the one proxy
  } else {
    const auto& lat = t[r.lat_proxy];
    const auto& bw = t[r.bw_proxy];
    r.threshold = largest;  // BwProxy never wins inside the range measured
    uint64_t prev = 0;
    for (uint64_t s : sizes) {
      double d = bw.at(s) - lat.at(s);
      if (d <= 0) {
        if (prev == 0) {
          r.threshold = s;
        } else {
          // Interpolate the crossing between prev (lat faster) and s.
          double d0 = bw.at(prev) - lat.at(prev);
          double f = d0 / (d0 - d);
          r.threshold =
              prev + static_cast<uint64_t>(f * static_cast<double>(s - prev));
        }
        break;
      }
      prev = s;
    }
  }
  // Equal shards over all M proxies take n / (M * slowest bandwidth), all
  // on BwProxy n / best: stripe when the first wins by stripe_gain.
  double slowest_bw = best_bw;
  for (auto& [p, m] : t) {
    slowest_bw =
        std::min(slowest_bw, static_cast<double>(largest) / m[largest]);
  }
  r.stripe = t.size() > 1 && static_cast<double>(t.size()) * slowest_bw >=
                                 stripe_gain * best_bw;
  const auto& bwp = t[r.bw_proxy];
  double peak = 0;
  for (auto& [s, sec] : bwp) peak = std::max(peak, s / sec);
  r.partition_bytes = largest;
  for (auto& [s, sec] : bwp) {
    if (s / sec >= full_bandwidth_fraction * peak) {
      r.partition_bytes = s;
      break;
    }
  }
  // P = alpha * beta from the least-squares line t = alpha + s / beta
  // through BwProxy's samples. The fit's intercept is the difference of
  // large numbers: where the largest samples are noisy (one host, a
  // millisecond each) it comes out negative, or near zero (an emulated
  // cluster's profiles gave P from 11 to 1,089 bytes for the same links in
  // one run, and the 11 cut a VGG-16 layer into 4 KiB shards: 1.21x the
  // iteration of a run whose profile said 743). The smallest size's time
  // less its streaming time at the largest size's bandwidth measures
  // alpha directly, and slightly high (a small transfer streams below the
  // peak rate), so P is the larger of the two; where neither is positive
  // (no fixed cost seen), P = 0.
  if (bwp.size() >= 2) {
    double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (auto& [s, sec] : bwp) {
      double x = static_cast<double>(s);
      n += 1, sx += x, sy += sec, sxx += x * x, sxy += x * sec;
    }
    double den = n * sxx - sx * sx;
    if (den > 0) {
      double slope = (n * sxy - sx * sy) / den;  // 1 / beta
      double alpha = (sy - slope * sx) / n;
      if (slope > 0 && alpha > 0) {
        r.pipeline_bytes = static_cast<uint64_t>(alpha / slope);
      }
    }
    const double inv_bw = bwp.at(largest) / static_cast<double>(largest);
    const double alpha =
        bwp.at(smallest) - static_cast<double>(smallest) * inv_bw;
    if (alpha > 0) {
      r.pipeline_bytes =
          std::max(r.pipeline_bytes, static_cast<uint64_t>(alpha / inv_bw));
    }
  }
  return r;
}

uint32_t StripeOwner(uint64_t key, uint32_t shard, uint32_t proxies) {
  return static_cast<uint32_t>((key + shard) % std::max<uint32_t>(1, proxies));
}

const RoutingTable* RouteHistory::For(uint64_t key, uint64_t round) const {
  if (entries_.empty()) return nullptr;
  for (size_t i = entries_.size(); i-- > 0;) {
    const Entry& e = entries_[i];
    auto f = e.from.find(key);
    uint64_t from = f != e.from.end() ? f->second : (i == 0 ? 0 : 1);
    if (from <= round) return &e.table;
  }
  return &entries_.front().table;
}

uint64_t ChooseShardBytes(const RoutingTable& t, uint64_t bytes,
                          size_t elem_bytes, uint32_t proxies, bool striped) {
  const uint64_t es = std::max<uint64_t>(1, elem_bytes);
  // B: what one node handles of the key; no shard is larger (nor smaller
  // than kMinShardBytes, which the tensor cap below may still undercut).
  const uint64_t node_bytes =
      striped && proxies > 1 ? (bytes + proxies - 1) / proxies : bytes;
  const uint64_t largest = std::max(node_bytes, kMinShardBytes);
  uint64_t shard =
      std::min(std::max(t.partition_bytes, kMinShardBytes), largest);
  if (t.pipeline_bytes > 0) {
    double b = std::sqrt(static_cast<double>(node_bytes) *
                         static_cast<double>(t.pipeline_bytes));
    const uint64_t per_node_cap =
        (node_bytes + kMaxShardsPerNode - 1) / kMaxShardsPerNode;
    shard = std::min(largest, std::max({kMinShardBytes, per_node_cap,
                                        static_cast<uint64_t>(b)}));
  }
  shard = std::max(shard, (bytes + kMaxShardsPerKey - 1) / kMaxShardsPerKey);
  shard = std::max<uint64_t>(es, shard - shard % es);
  if ((bytes + shard - 1) / shard > kMaxShardsPerKey) shard += es;
  return std::min<uint64_t>(shard, bytes);
}

double PredictIteration(uint64_t total_bytes, uint64_t proxy_bytes, int workers,
                        double t_forward, double t_backward, double bw_proxy,
                        double bw_worker, double sharing) {
  double p = std::max(1, workers);
  double f = 2.0 * (p - 1) / p;
  double n = static_cast<double>(total_bytes);
  double m = static_cast<double>(std::min(proxy_bytes, total_bytes));
  double ring = f * (n - m) / bw_worker, push = f * m / bw_proxy;
  double gpu = t_forward + t_backward + ring;
  double proxy = t_forward + push;
  double overlap = std::max(0.0, std::min(ring, push - t_backward));
  return std::max(gpu, proxy) + std::clamp(sharing, 0.0, 1.0) * overlap;
}

DualSyncPlan ChooseDualSync(uint64_t total_bytes, int workers, double t_forward,
                            double t_backward, double bw_proxy,
                            double bw_worker, double sharing) {
  double p = std::max(1, workers);
  double f = 2.0 * (p - 1) / p;
  double n = static_cast<double>(total_bytes);
  DualSyncPlan plan;
  plan.proxy_bytes = total_bytes;
  if (f > 0) {
    // Breakpoints of T(m): where the two branches meet (which is also where
    // the ring's time equals the proxies' time after backward:
    //   T_BP + f(n-m)/Bw = f m/Bp  =>  m = (T_BP + f n/Bw) / (f/Bp + f/Bw)),
    // and where the proxies' time equals backward (m = T_BP Bp / f).
    double meet =
        (t_backward + f * n / bw_worker) / (f / bw_proxy + f / bw_worker);
    double after_backward = t_backward * bw_proxy / f;
    const double all_proxies =
        PredictIteration(total_bytes, total_bytes, workers, t_forward,
                         t_backward, bw_proxy, bw_worker, sharing);
    double best = all_proxies;
    for (double c : {meet, after_backward, 0.0}) {
      auto m = static_cast<uint64_t>(std::clamp(c, 0.0, n));
      double t = PredictIteration(total_bytes, m, workers, t_forward,
                                  t_backward, bw_proxy, bw_worker, sharing);
      if (t < best * (1 - 1e-12) && t < all_proxies * (1 - kDualSyncMinGain)) {
        best = t;
        plan.proxy_bytes = m;
      }
    }
  }
  plan.predicted_seconds =
      PredictIteration(total_bytes, plan.proxy_bytes, workers, t_forward,
                       t_backward, bw_proxy, bw_worker, sharing);
  return plan;
}

int ChooseRingLayers(const std::vector<uint64_t>& layer_bytes,
                     const DualSyncPlan& plan, int workers, double t_forward,
                     double t_backward, double bw_proxy, double bw_worker,
                     double sharing) {
  uint64_t total = 0;
  for (uint64_t b : layer_bytes) total += b;
  if (plan.proxy_bytes >= total) return 0;
  const uint64_t want = total - plan.proxy_bytes;
  int below = 0;  // the longest prefix within `want`
  uint64_t acc = 0;
  while (below < static_cast<int>(layer_bytes.size()) &&
         acc + layer_bytes[below] <= want) {
    acc += layer_bytes[below++];
  }
  if (below == static_cast<int>(layer_bytes.size())) return below;
  const uint64_t above = acc + layer_bytes[below];
  auto predict = [&](uint64_t ring_bytes) {
    return PredictIteration(total, total - ring_bytes, workers, t_forward,
                            t_backward, bw_proxy, bw_worker, sharing);
  };
  return predict(above) < predict(acc) ? below + 1 : below;
}

double SharingFromProbe(double t_worker, double t_proxy, double t_both) {
  double hi = std::max(t_worker, t_proxy), lo = std::min(t_worker, t_proxy);
  if (!(lo > 0)) return 0;
  return std::clamp((t_both - hi / 2) / (lo / 2), 0.0, 1.0);
}

uint64_t PipelineBytesForSharing(uint64_t pipeline_bytes,
                                 double inout_sharing) {
  if (pipeline_bytes == 0) return 0;
  double hidden =
      std::max(1.0 - std::clamp(inout_sharing, 0.0, 1.0), 1.0 / 1024);
  return static_cast<uint64_t>(static_cast<double>(pipeline_bytes) / hidden);
}

}  // namespace membox::ps
